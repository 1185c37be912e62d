"""Write ``src/pagedattn/repro/sim/data/a100_profile.json``: the few rows of Vidur's A100 profiles that the simulator's measured
step-time constants come from (issue 30, part 3), and print the constants (``pagedattn.repro.sim.cost_profile.derive``).

Inputs (not committed; the two large CSVs are 0.7 MB each), read from the repository ``microsoft/vidur`` (MIT):

    git -C <vidur> show bee57dafa1eb2dc422dcaec46a66975599a6a242:data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv > /tmp/vidur/mlp_7b.csv
    git -C <vidur> show bee57dafa1eb2dc422dcaec46a66975599a6a242:data/profiling/compute/a100/internlm/internlm-20b/mlp.csv > /tmp/vidur/mlp_internlm20b.csv
    git -C <vidur> show 6d98aa8f71696520acc603d87439e77cc78160a7:data/profiling/a100/cpu_overheads.csv > /tmp/vidur/cpu_overheads.csv

(both mlp.csv files are unchanged at the newest commit 7d47513; cpu_overheads.csv is identical at 7f14d6a and
6d98aa8 and absent from later commits). ``attention.csv`` is a Git LFS pointer in microsoft/vidur, so its rows were
read from a fork that holds the data and are transcribed below (``ATTENTION_DECODE`` / ``ATTENTION_PREFILL``).

Usage: ``PYTHONPATH=src python benchmarks/derive_a100_profile.py [--inputs /tmp/vidur]``
"""
from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from pagedattn.repro.sim.cost_profile import LAYER_OPS, OVERHEAD_COLUMNS, PREFILL_TOKENS, PROFILE_PATH, SOURCE_SHA256, \
    check_sources, derive, verify_source

VIDUR = "microsoft/vidur"
MLP_COMMIT = "bee57dafa1eb2dc422dcaec46a66975599a6a242"
CPU_COMMIT = "6d98aa8f71696520acc603d87439e77cc78160a7"
ATTN_REPO, ATTN_COMMIT = "sw5sh/cs378-assignment3", "7ac2fe9fb6cea9d4630659a10c5cccfc9fbdd776"
ATTN_PATH = "data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/attention.csv"
#: Decode token counts (= batch sizes) and prefill token counts whose mlp.csv rows the table keeps.
DECODE_TOKENS = (8, 16, 32, 48, 64, 96, 112, 128)

#: Llama-2-7B attention.csv rows (tensor parallel 1, block 16, FlashAttention backend, is_prefill False): medians in
#: ms of ``attn_input_reshape``, ``attn_decode``, ``attn_output_reshape`` for ``batch`` requests of ``context``
#: (``kv_cache_size``) tokens each. Read by character offset of the file (``offset``): 0, 161000, 400000.
ATTENTION_DECODE = [
    # batch, context, input_reshape, decode, output_reshape, offset
    (8, 32, 0.0, 0.018, 0.002, 0), (32, 32, 0.0, 0.048, 0.002, 0), (64, 32, 0.0, 0.097, 0.002, 0),
    (128, 224, 0.0, 0.306, 0.004, 161000),
    (8, 256, 0.0, 0.041, 0.002, 161000), (16, 256, 0.0, 0.072, 0.002, 161000), (32, 256, 0.0, 0.114, 0.002, 161000),
    (48, 256, 0.0, 0.159, 0.002, 161000), (64, 256, 0.0, 0.203, 0.003, 161000),
    (32, 576, 0.0, 0.196, 0.002, 400000), (64, 576, 0.0, 0.356, 0.002, 400000), (96, 576, 0.0, 0.495, 0.003, 400000),
    (112, 576, 0.0, 0.566, 0.003, 400000),
]
#: Prefill rows (batch 1, no cached context, tensor parallel 1): ``prefill_chunk_size``, medians of the reshapes and
#: ``attn_prefill``; read at offset 2662000. The 4096-token row was not read (the tensor-parallel-1 block ends
#: between offsets 2678000 and 2762000).
ATTENTION_PREFILL = [(3072, 0.0, 1.603, 0.033, 2662000)]


def mlp_rows(path: Path, tokens: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """``{tokens: {op: median ms}}`` for tensor parallel 1 (the first row of a token count that repeats)."""
    out: dict[str, dict[str, float]] = {}
    meta = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            t = int(r["num_tokens"])
            if r["num_tensor_parallel_workers"] != "1" or t not in tokens or str(t) in out:
                continue
            out[str(t)] = {op: float(r[f"time_stats.{op}.median"]) for op in LAYER_OPS}
            meta = {"hidden": int(r["n_embd"]), "ffn": int(r["n_expanded_embd"]), "n_head": int(r["n_head"]),
                    "n_kv_head": int(r["n_kv_head"]), "gated_mlp": r["use_gated_mlp"] == "True"}
    assert len(out) == len(tokens), f"{path}: missing token counts {set(map(str, tokens)) - set(out)}"
    return {**meta, "dtype_bytes": 2, "ops": dict(sorted(out.items(), key=lambda kv: int(kv[0])))}


def cpu_rows(path: Path, models: tuple[str, ...]) -> list[dict]:
    out = []
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["model_name"] in models and r["tensor_parallel_degree"] == "1":
                out.append({"model_name": r["model_name"], "batch_size": int(r["batch_size"]),
                            **{c: round(float(r[f"{c}_median"]), 4) for c in OVERHEAD_COLUMNS},
                            "ray_comm_time_mean": round(float(r["ray_comm_time_mean"]), 4)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=Path, default=Path("/tmp/vidur"))
    ap.add_argument("--out", type=Path, default=PROFILE_PATH)
    args = ap.parse_args()
    tokens = tuple(sorted(set(DECODE_TOKENS) | set(PREFILL_TOKENS)))
    inputs = {"mlp_llama2_7b": args.inputs / "mlp_7b.csv", "mlp_internlm_20b": args.inputs / "mlp_internlm20b.csv",
              "cpu_overheads": args.inputs / "cpu_overheads.csv"}
    digests = {key: verify_source(key, path) for key, path in inputs.items()}  # another file or commit: refused
    table = {
        "about": "Rows of Vidur's A100-80GB profiles (medians, ms) behind pagedattn.repro.sim.cost_profile; written by "
                 "benchmarks/derive_a100_profile.py. Licence of the data: MIT, Copyright (c) Microsoft Corporation.",
        "sources": {
            "mlp_llama2_7b": {"repo": VIDUR, "commit": MLP_COMMIT,
                              "path": "data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv",
                              "sha256": digests["mlp_llama2_7b"]},
            "mlp_internlm_20b": {"repo": VIDUR, "commit": MLP_COMMIT,
                                 "path": "data/profiling/compute/a100/internlm/internlm-20b/mlp.csv",
                                 "sha256": digests["mlp_internlm_20b"]},
            "cpu_overheads": {"repo": VIDUR, "commit": CPU_COMMIT, "path": "data/profiling/a100/cpu_overheads.csv",
                              "sha256": digests["cpu_overheads"]},
            "attention_llama2_7b": {"repo": ATTN_REPO, "commit": ATTN_COMMIT, "path": ATTN_PATH,
                                    "note": "microsoft/vidur holds a Git LFS pointer here (blob 6ce0a3b, size "
                                            "10680357); this fork holds a 10,680,357-byte copy",
                                    "sha256": SOURCE_SHA256["attention_llama2_7b"],
                                    "sha256_missing": "the copy (10.7 MB) was read in 16,000-character pages, never "
                                                      "whole; its rows are transcribed by character offset"},
        },
        "models": {"llama2_7b": mlp_rows(args.inputs / "mlp_7b.csv", tokens),
                   "internlm_20b": mlp_rows(args.inputs / "mlp_internlm20b.csv", tokens)},
        "attention_decode": [dict(zip(("batch", "context", "input_reshape", "decode", "output_reshape", "offset"), r))
                             for r in ATTENTION_DECODE],
        "attention_prefill": [dict(zip(("tokens", "input_reshape", "prefill", "output_reshape", "offset"), r))
                              for r in ATTENTION_PREFILL],
        "cpu_overheads": cpu_rows(args.inputs / "cpu_overheads.csv", ("meta-llama/Llama-2-7b-hf", "microsoft/phi-2")),
    }
    check_sources(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    d = derive(table)
    for k, v in d.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
