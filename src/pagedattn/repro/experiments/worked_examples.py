"""Experiment 00: the tour's worked examples (paper §3-§4; the study note's §9, exercises 1 and 4), computed, checked.

Every number the tour (``notebooks/00_tour.ipynb``) shows comes from the real code, none is typed in:

- §3: KV bytes per token of OPT-13B, LLaMA-2-70B (GQA-8) and a 7B model (``config.ModelSpec``);
- §4.2, Fig. 6: a 40-token request in blocks of 16 gets physical blocks in the order the pool freed them
  (``memory.BlockManager``, one sequence at a time through ``memory.per_sequence.PerSequence``);
- §4.4, Fig. 8: four samples share a block; copy-on-write when one writes to it;
- a run of the small trained model ``opt-stdlib`` through ``LLM.generate``;
- the live view's trace: the block pool recorded after every step of a real engine run with a shared prefix and
  parallel sampling (``tour.record_trace``), saved as JSON, a GIF and PNG frames.

Each check holds by construction (arithmetic, the block manager's bookkeeping): the claims are invariants, not
evidence. The paper's and the note's values come from ``pagedattn.repro.paper``.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pandas as pd

from pagedattn.repro.experiments import tour
from pagedattn.config import block_fills, blocks_needed, format_bytes
from pagedattn.repro.paper import LLAMA2_70B, LLAMA_7B, OPT_13B
from pagedattn.memory import BlockManager
from pagedattn.memory.per_sequence import PerSequence
from pagedattn.repro.paper import (BLOCK_FILLS_40_TOKENS, BLOCKS_FOR_1000_TOKENS, COW_REF_COUNTS, DEFAULT_BLOCK_SIZE,
                             KV_GB_2048_TOKENS_OPT13B, KV_KB_PER_TOKEN)
from pagedattn.repro.report.results import RESULTS_DIR, Claim, hardware_label, write_summary

EXPERIMENT = "00_tour"
MODEL = "KV arithmetic (config) + BlockManager + opt-stdlib engine"
SPECS = {"opt_13b": OPT_13B, "llama2_70b": LLAMA2_70B, "llama_7b": LLAMA_7B}
#: §4.2's example: ten one-token requests fill a pool of 10 blocks, then these finish, in this order, and a 40-token
#: request arrives: it gets exactly the freed blocks, in the free list's order.
FREED = (5, 2, 9)
#: The engine run's prompts (§ 4 of the tour).
PROMPTS = ["def is_even(n):\n    \"\"\"", "for i in range(", "class Stack:\n    def __init__(self):\n        "]


def kv_sizes() -> tuple[pd.DataFrame, list[Claim]]:
    """§3: each model's KV bytes per token and per 2048-token request, beside the paper's (the note's) values."""
    table = pd.DataFrame([{"model": s.name, "layers": s.num_layers, "kv heads": s.num_kv_heads, "head dim": s.head_dim,
                           "KV per token": format_bytes(s.kv_bytes_per_token),
                           "2048-token request": format_bytes(s.kv_bytes(2048)),
                           "paper / note (KB)": KV_KB_PER_TOKEN[s.name]} for s in SPECS.values()])
    kb = {key: s.kv_bytes_per_token / 1024 for key, s in SPECS.items()}
    paper = {key: KV_KB_PER_TOKEN[s.name] for key, s in SPECS.items()}
    mb_2048 = OPT_13B.kv_bytes(2048) / 1024**2
    notes = {"llama_7b": "the study note's 7B example"}
    claims = [Claim("kv_bytes_per_token.opt_13b", paper["opt_13b"], kb["opt_13b"], "KB", "equal",
                    kb["opt_13b"] == paper["opt_13b"], kind="invariant"),
              Claim("kv_bytes_2048_tokens.opt_13b", KV_GB_2048_TOKENS_OPT13B, mb_2048 / 1000, "GB", "equal",
                    mb_2048 == paper["opt_13b"] * 2048 / 1024,
                    f"{paper['opt_13b']} KB x 2048 = {paper['opt_13b'] * 2048 // 1024} MB; the paper's "
                    f"{KV_GB_2048_TOKENS_OPT13B} GB counts 1000 MB per GB (= {mb_2048 / 1024:g} GiB)",
                    kind="invariant")]
    claims += [Claim(f"kv_bytes_per_token.{key}", paper[key], kb[key], "KB", "equal", kb[key] == paper[key],
                     notes.get(key, ""), kind="invariant") for key in ("llama2_70b", "llama_7b")]
    n = blocks_needed(1000, DEFAULT_BLOCK_SIZE)
    claims.append(Claim("blocks_for_1000_tokens", BLOCKS_FOR_1000_TOKENS, n, "blocks", "equal",
                        n == BLOCKS_FOR_1000_TOKENS, "study note exercise 1: the last block is half full",
                        kind="invariant"))
    return table, claims


def forty_tokens() -> dict:
    """§4.2, Fig. 6 (the note's §9.2): a pool of 10 blocks is handed to ten one-token requests; ``FREED`` finish; a
    40-token request then gets blocks ``FREED``, filled 16 + 16 + 8. Returns the block manager, the request's block
    table, labels for drawing and the claim."""
    kv = BlockManager(block_size=DEFAULT_BLOCK_SIZE, num_gpu_blocks=10, watermark=0.0)
    per_seq = PerSequence(kv)  # one sequence at a time, as the figure tells it
    for i in range(10):
        per_seq.allocate(100 + i, num_tokens=1)  # ten short requests take blocks 0..9
    for b in FREED:
        per_seq.free(100 + b)  # they finish: the free list is FREED, in order
    per_seq.allocate(0, num_tokens=40)  # the 40-token request
    table = kv.block_table(0)
    fills = block_fills(40, DEFAULT_BLOCK_SIZE)
    claim = Claim("blocks_for_40_tokens", BLOCK_FILLS_40_TOKENS, fills, "tokens per block", "equal",
                  fills == BLOCK_FILLS_40_TOKENS and table == list(FREED), f"physical blocks {table}", kind="invariant")
    labels = {0: ("req", 0), **{100 + i: (f"other{i}", 0) for i in range(10)}}
    return {"kv": kv, "table": table, "fills": fills, "labels": labels, "claim": claim}


def copy_on_write() -> dict:
    """§4.4, Fig. 8 (the note's exercise 4): a prompt of 8 tokens lands in block 7, three forks share it (reference
    count 4), and output 3 writes a token: the block is shared and not full, so it is copied. Returns the block
    manager, the counts before and after, the ``(src, dst)`` copy, labels for drawing and the claim."""
    kv = BlockManager(block_size=DEFAULT_BLOCK_SIZE, num_gpu_blocks=10, watermark=0.0)
    per_seq = PerSequence(kv)
    for i in range(7):
        per_seq.allocate(100 + i, num_tokens=1)  # blocks 0..6 are taken by other requests
    per_seq.allocate(0, num_tokens=8)  # the prompt (8 tokens) lands in block 7
    for child in (1, 2, 3):
        per_seq.fork(0, child)  # samples 1..3 share it
    before = kv.block_view().ref_counts[7]
    copy = per_seq.append_slot(2)  # output 3 (sequence 2) writes a token
    after = kv.block_view().ref_counts[7]
    kv.check_invariants()
    claim = Claim("cow_refcount_4_to_3", " -> ".join(map(str, COW_REF_COUNTS)), f"{before} -> {after}", "", "equal",
                  (before, after) == COW_REF_COUNTS, "study note exercise 4", kind="invariant")
    labels = {s: ("out", s + 1) for s in range(4)} | {100 + i: (f"other{i}", 0) for i in range(7)}  # outputs 1..4
    return {"kv": kv, "before": before, "after": after, "copy": copy, "labels": labels, "claim": claim}


def generate(model, tokenizer, quick: bool) -> dict:
    """``LLM.generate`` on ``PROMPTS`` (greedy): the whole engine on ``opt-stdlib``. Returns the LLM and outputs."""
    from pagedattn.llm import LLM
    from pagedattn.sequence import SamplingParams

    llm = LLM(model, tokenizer, block_size=DEFAULT_BLOCK_SIZE, num_gpu_blocks=64)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12 if quick else 40), use_tqdm=False)
    return {"llm": llm, "outputs": outputs}


def live_trace(model, tokenizer, quick: bool, out_dir: Path) -> dict:
    """The live view's trace (``tour.tour_requests`` on ``tour.tour_engine``), checked frame by frame (the same
    checks as ``tests/test_tour.py``: reference counts = block-table entries + pins), and saved to ``out_dir``: the
    frames as JSON (``block_pool_trace.json``), a GIF, and PNGs of the key frames."""
    engine = tour.tour_engine(model, tokenizer, block_size=8, num_gpu_blocks=40)
    arrivals, prefix_len = tour.tour_requests(tokenizer, max_tokens=6 if quick else 14)
    frames, outputs = tour.record_trace(engine, arrivals)
    if not all(f.table_refs() == f.ref_counts for f in frames):
        raise RuntimeError("a frame's reference counts differ from its block-table entries + pins")
    cow_frames = [i for i, f in enumerate(frames) if f.num_copies]
    max_shared = max(max(f.ref_counts) for f in frames)
    gif = tour.save_gif(frames, out_dir / "block_pool.gif")
    tour.save_trace(frames, out_dir / "block_pool_trace.json")
    colors = tour.request_colors(frames)
    key = sorted({0, 1, cow_frames[0] if cow_frames else 1,
                  next(i for i, f in enumerate(frames) if "C" in f.new_requests), len(frames) - 1})
    for i in key:
        (out_dir / f"block_pool_frame{i:02d}.png").write_bytes(tour.frame_png(frames[i], colors))
    seen = bool(cow_frames) and max_shared >= 4
    claim = Claim("tour_trace_consistent", "ref count = sharing block tables", seen, "",
                  "copy-on-write seen, a block shared >= 4 ways", seen,
                  f"{len(frames)} frames of a real engine run on opt-stdlib", kind="invariant")
    return {"frames": frames, "outputs": outputs, "prefix_len": prefix_len, "cow_frames": cow_frames,
            "max_shared": max_shared, "gif": gif, "key_frames": key, "claim": claim}


def run(quick: bool = False, results_dir: str | Path = RESULTS_DIR) -> dict:
    """Every worked example and check; writes the trace files and ``summary.json`` (all claims invariants) to
    ``<results_dir>/00_tour/`` and returns each example's objects (for the tour to draw) and the claims."""
    from pagedattn.repro.experiments.zoo import load_model

    out_dir = Path(results_dir) / EXPERIMENT
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes, claims = kv_sizes()
    forty, cow = forty_tokens(), copy_on_write()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tokenizer = load_model("opt-stdlib")
    gen = generate(model, tokenizer, quick)
    trace = live_trace(model, tokenizer, quick, out_dir)
    claims = claims + [forty["claim"], cow["claim"], trace["claim"]]  # each made an invariant where it is built
    write_summary(out_dir, EXPERIMENT, hardware_label("cpu"), MODEL, quick, claims)
    return {"kv_sizes": sizes, "forty_tokens": forty, "copy_on_write": cow, "generate": gen, "trace": trace,
            "model": model, "tokenizer": tokenizer, "claims": claims, "out_dir": out_dir}
