"""A small real language model, trained here: `opt-stdlib`, an OPT of a few million parameters on the Python stdlib.

Project addition, not in the paper. The paper's sharing results (§4.4, §6.3: parallel sampling and beam search,
Figs. 14-15) depend on what the model predicts: beams only share blocks when their candidates agree, which a
random-weight model never gives. So the project trains its own small OPT on the ``.py`` files of the Python
standard library, on the CPU, in minutes, and commits the checkpoint under ``models/opt-stdlib/`` with a
``record.json`` (corpus, budget, losses, versions, sha256 of every file) so every machine reproduces the same numbers.

    model, tok = load_model("opt-stdlib")               # verifies the committed checkpoint, or trains it if absent
    python -m pagedattn.repro.experiments.zoo train opt-stdlib [--quick]  # (re)train; `make model` runs the full one
    python -m pagedattn.repro.experiments.zoo sample opt-stdlib "def __init__(self"

The folder is an ordinary Hugging Face checkpoint: ``OPTForCausalLM.from_pretrained(path)`` and
``PreTrainedTokenizerFast.from_pretrained(path)`` load it. Weights are stored in fp16 to keep the folder small;
``load_model`` casts to the requested dtype. The tokenizer follows OPT's conventions: ``<s>`` 0, ``<pad>`` 1,
``</s>`` 2 (BOS and EOS, prepended to every encoded text, as OPT's tokenizer does), ``<unk>`` 3.

Corpus: the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``, minus tests, ``site-packages``, ``idlelib``
and generated data (``encodings`` charmap tables, ``pydoc_data``); split by file, deterministically (sha256 of the
relative path), about 1 file in 20 to validation. The record also holds an add-one-smoothed unigram model's
perplexity (same tokenizer, fit on train) on the same validation tokens, the bar the trained model must clear.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedattn.repro import REPO_ROOT

MODELS_DIR = REPO_ROOT / "models"
SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>"]  # OPT's ids: bos/eos "</s>" = 2, pad = 1
PAD_ID, EOS_ID = 1, 2
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"}
RETRAIN_HINT = "retrain it with `make model` or `python -m pagedattn.repro.experiments.zoo train {name}{quick}`"


@dataclass(frozen=True)
class ZooConfig:
    """Everything that defines one trained model: tokenizer, architecture, corpus split and training budget."""
    name: str
    vocab_size: int = 4096
    num_layers: int = 4
    hidden: int = 256
    heads: int = 4
    ffn: int = 1024
    max_positions: int = 512
    seq_len: int = 256          # training and evaluation window
    batch: int = 16
    steps: int = 800
    lr: float = 1.5e-3
    warmup: int = 40
    min_lr_frac: float = 0.1    # cosine decays to this fraction of lr
    weight_decay: float = 0.1
    val_one_in: int = 20        # a file goes to validation when sha256(path) % val_one_in == 0
    train_file_one_in: int = 1  # use every k-th training file (the quick variant trains on a subset)
    seed: int = 0
    threads: int | None = None  # torch threads while training (None: torch's default, 2 for the committed model);
                                # 1 is fastest on a busy shared CPU, where 2 threads on 2 cores oversubscribe


KNOWN_MODELS: dict[str, ZooConfig] = {"opt-stdlib": ZooConfig(name="opt-stdlib")}
QUICK_OVERRIDES = dict(num_layers=2, hidden=128, heads=4, ffn=512, vocab_size=2048, steps=220, lr=3e-3, warmup=20,
                       train_file_one_in=3, threads=1)


class CheckpointError(ValueError):
    """A model folder that is incomplete, corrupted or truncated (its files do not match record.json)."""


def get_config(name: str, quick: bool = False) -> ZooConfig:
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}")
    cfg = KNOWN_MODELS[name]
    return replace(cfg, name=f"{name}-quick", **QUICK_OVERRIDES) if quick else cfg


def model_path(name: str, quick: bool = False, root: str | Path | None = None) -> Path:
    """Folder of a model: ``models/<name>/`` (``models/<name>-quick/`` for the quick variant, not committed)."""
    return Path(root or MODELS_DIR) / get_config(name, quick).name


# ----------------------------------------------------------------------------------------------- corpus
def corpus_files(stdlib: str | Path | None = None) -> tuple[Path, list[str]]:
    """Sorted relative paths (posix) of the stdlib's .py files, minus tests, site-packages and generated data."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    rels = [p.relative_to(root).as_posix() for p in root.rglob("*.py")]
    return root, sorted(r for r in rels if not SKIP_DIRS.intersection(r.split("/")[:-1]))


def split_files(rels: list[str], cfg: ZooConfig) -> tuple[list[str], list[str]]:
    """Deterministic split by file: validation when sha256(relative path) % val_one_in == 0."""
    is_val = [int(hashlib.sha256(r.encode()).hexdigest(), 16) % cfg.val_one_in == 0 for r in rels]
    train = [r for r, v in zip(rels, is_val) if not v][:: cfg.train_file_one_in]
    return train, [r for r, v in zip(rels, is_val) if v]


def read_texts(root: Path, rels: list[str]) -> list[str]:
    return [(root / r).read_bytes().decode("utf-8", errors="replace") for r in rels]


# ----------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (the `tokenizers` library) wrapped as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="</s> $A", pair="</s> $A </s> $B",
                                                       special_tokens=[("</s>", EOS_ID)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """One token stream: each file as ``</s> tokens...`` (what the tokenizer itself produces for a text)."""
    encs = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=True)
    return torch.tensor([i for e in encs for i in e.ids], dtype=torch.long)


# ----------------------------------------------------------------------------------------------- evaluation
def val_windows(stream: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows: inputs stream[k*T : k*T+T], targets shifted by one; each token predicted once."""
    n = (len(stream) - 1) // seq_len
    x = stream[: n * seq_len].view(n, seq_len)
    y = stream[1 : n * seq_len + 1].view(n, seq_len)
    return x, y


@torch.no_grad()
def perplexity(model, x: torch.Tensor, y: torch.Tensor, batch: int = 32) -> float:
    model.eval()
    nll = 0.0
    for i in range(0, len(x), batch):
        logits = model(input_ids=x[i : i + batch]).logits.float()
        nll += F.cross_entropy(logits.flatten(0, 1), y[i : i + batch].flatten(), reduction="sum").item()
    return math.exp(nll / y.numel())


def unigram_perplexity(train: torch.Tensor, y: torch.Tensor, vocab_size: int) -> float:
    """Add-one smoothed unigram over the vocabulary, fit on the train stream, scored on the targets y."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return math.exp(-logp[y.flatten()].mean().item())


# ----------------------------------------------------------------------------------------------- training
def lr_at(step: int, cfg: ZooConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def opt_config(cfg: ZooConfig):
    from transformers import OPTConfig

    return OPTConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, num_hidden_layers=cfg.num_layers,
                     ffn_dim=cfg.ffn, num_attention_heads=cfg.heads, max_position_embeddings=cfg.max_positions,
                     word_embed_proj_dim=cfg.hidden, do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0,
                     activation_dropout=0.0, init_std=0.02, pad_token_id=PAD_ID, bos_token_id=EOS_ID,
                     eos_token_id=EOS_ID, tie_word_embeddings=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def train(name: str = "opt-stdlib", quick: bool = False, root: str | Path | None = None,
          stdlib: str | Path | None = None, progress: bool = True) -> Path:
    """Train tokenizer and model from scratch, save (fp16 safetensors + record.json) and return the folder.

    Writes into a temporary folder beside the target and renames it at the end, so an interrupted run never
    leaves a folder that looks complete. Overwrites an existing model folder of the same name.
    """
    cfg = get_config(name, quick)
    out = model_path(name, quick, root)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or threads)
    try:
        return _train(cfg, out, stdlib, progress)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: ZooConfig, out: Path, stdlib: str | Path | None, progress: bool) -> Path:
    from tqdm.auto import tqdm

    from pagedattn.repro.progress import interactive
    from transformers import OPTForCausalLM

    import tokenizers
    import transformers

    t0, cpu0 = time.time(), time.process_time()
    torch.manual_seed(cfg.seed)

    src, rels = corpus_files(stdlib)
    train_rels, val_rels = split_files(rels, cfg)
    train_texts, val_texts = read_texts(src, train_rels), read_texts(src, val_rels)
    tokenizer = train_tokenizer(train_texts, cfg.vocab_size)
    train_ids, val_ids = encode_stream(tokenizer, train_texts), encode_stream(tokenizer, val_texts)
    x_val, y_val = val_windows(val_ids, cfg.seq_len)
    t_data = time.time() - t0

    model = OPTForCausalLM(opt_config(cfg))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    losses: list[float] = []
    model.train()
    bar = tqdm(range(cfg.steps), desc=f"train {cfg.name}", disable=not (progress and interactive()), mininterval=2.0)
    for step in bar:
        starts = torch.randint(0, len(train_ids) - cfg.seq_len - 1, (cfg.batch,), generator=gen)
        batch = torch.stack([train_ids[s : s + cfg.seq_len + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    t_train = time.time() - t0 - t_data

    model = model.half()  # what is stored, and so what every machine evaluates
    val_ppl = perplexity(model.float(), x_val, y_val)
    uni_ppl = unigram_perplexity(train_ids, y_val, cfg.vocab_size)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)
    model.half().save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tok_cfg = json.loads((tmp / "tokenizer_config.json").read_text())  # the class name every v4/v5 release knows
    (tmp / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "tokenizer_class": "PreTrainedTokenizerFast"},
                                                          indent=2) + "\n")
    tail = losses[-max(1, cfg.steps // 20):]
    record = {
        "name": cfg.name,
        "note": "project addition (not in the paper): a small OPT trained on the Python stdlib for §6.3-style "
                "beam search / parallel sampling results; see src/pagedattn/repro/experiments/zoo.py",
        "config": asdict(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus": {"root": str(src), "python": platform.python_version(),
                   "files": {"train": len(train_rels), "val": len(val_rels)},
                   "bytes": {"train": sum(len(t.encode()) for t in train_texts),
                             "val": sum(len(t.encode()) for t in val_texts)},
                   "tokens": {"train": len(train_ids), "val": len(val_ids), "val_scored": y_val.numel()}},
        "training": {"steps": cfg.steps, "batch": cfg.batch, "seq_len": cfg.seq_len,
                     "tokens_seen": cfg.steps * cfg.batch * cfg.seq_len, "threads": torch.get_num_threads(),
                     "wall_s": {"data_and_tokenizer": round(t_data, 1), "train": round(t_train, 1),
                                "total": round(time.time() - t0, 1)},
                     "cpu_s": round(time.process_time() - cpu0, 1),  # all threads; ~threads x wall when unshared
                     "train_loss_first": round(losses[0], 4), "train_loss_final": round(sum(tail) / len(tail), 4)},
        "eval": {"val_ppl": round(val_ppl, 3), "unigram_val_ppl": round(uni_ppl, 3),
                 "unigram_over_model": round(uni_ppl / val_ppl, 2),
                 "how": f"fp16-stored weights run in fp32; non-overlapping {cfg.seq_len}-token windows over the "
                        "validation files; unigram: add-one smoothed, fit on the train tokens"},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "python": sys.version.split()[0]},
        "sha256": {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()},
    }
    (tmp / "record.json").write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


# ----------------------------------------------------------------------------------------------- loading
def verify(path: str | Path, name: str = "opt-stdlib", quick: bool = False) -> dict:
    """Check every file listed in record.json against its sha256; return the record or raise CheckpointError."""
    path = Path(path)
    hint = RETRAIN_HINT.format(name=name, quick=" --quick" if quick else "")
    try:
        record = json.loads((path / "record.json").read_text())
        expected = record["sha256"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"model folder {path} has no valid record.json ({e}); {hint}") from None
    for fname, digest in expected.items():
        f = path / fname
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing; {hint}")
        if sha256_file(f) != digest:
            raise CheckpointError(f"checkpoint file {f} is corrupted or truncated (sha256 differs from "
                                  f"record.json, size {f.stat().st_size} bytes); {hint}")
    return record


def load_model(name: str = "opt-stdlib", quick: bool = False, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, root: str | Path | None = None):
    """Return (OPTForCausalLM in eval mode, PreTrainedTokenizerFast), training the model first if its folder is
    missing. An existing folder is verified against the sha256 in its record.json before use."""
    from transformers import OPTForCausalLM, PreTrainedTokenizerFast

    path = model_path(name, quick, root)
    if not path.exists():
        train(name, quick, root)
    record = verify(path, name, quick)
    same = {k: v for k, v in asdict(get_config(name, quick)).items() if k != "threads"}  # threads: rounding only
    if {k: v for k, v in record.get("config", {}).items() if k != "threads"} != same:
        warnings.warn(f"{path} was trained with a config that differs from zoo.py's {name!r}; "
                      + RETRAIN_HINT.format(name=name, quick=" --quick" if quick else ""), stacklevel=2)
    from pagedattn.repro.progress import quiet_transformers
    quiet_transformers()
    model = OPTForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, PreTrainedTokenizerFast.from_pretrained(path)


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, max_new_tokens: int = 48) -> str:
    """Greedy continuation with Hugging Face generate (the reference the engine is compared with)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=PAD_ID)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pagedattn.repro.experiments.zoo", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train (or retrain) a model and write models/<name>/")
    s = sub.add_parser("sample", help="print a greedy continuation of a prompt")
    for p in (t, s):
        p.add_argument("name", choices=sorted(KNOWN_MODELS))
        p.add_argument("--quick", action="store_true", help="the small CI variant (models/<name>-quick/)")
        p.add_argument("--root", default=None, help="models folder (default: the repository's models/)")
    s.add_argument("prompt", nargs="?", default="def __init__(self")
    s.add_argument("--max-new-tokens", type=int, default=48)
    a = ap.parse_args(argv)
    if a.cmd == "train":
        out = train(a.name, a.quick, a.root)
        rec = json.loads((out / "record.json").read_text())
        print(json.dumps({"path": str(out), **rec["eval"], "wall_s": rec["training"]["wall_s"]}, indent=2))
    else:
        model, tok = load_model(a.name, a.quick, root=a.root)
        print(a.prompt + greedy(model, tok, a.prompt, a.max_new_tokens))


if __name__ == "__main__":
    main()
