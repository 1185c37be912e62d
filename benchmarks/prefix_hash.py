"""The cost of prefix-cache identity: BLAKE2b digests vs Python's ``hash`` (issue 12, item 7; prefix caching, §4.4).

Every full block that prefix caching looks up or registers is identified by a digest chained over its parent's
digest and its token ids (``pagedattn.memory.block_manager.block_hashes``). It replaced Python's built-in ``hash``
of ``(parent, tuple(tokens))``, which is 64 bits, not collision resistant, and for integers not randomised, so that
two prompts could be crafted to share K/V. This script times both on the same token ids, interleaved, and reports
the time per block; then, for context, one offline simulation of notebook 07 (automatic prefix caching, five-shot
prefix) run with each identity. Tracking numbers (CPU timings are noisy), not claims.

Writes ``results/benchmarks/prefix_hash.json``.

    .venv/bin/python benchmarks/prefix_hash.py [--quick] [--out PATH]
"""
from __future__ import annotations

import argparse
import os
import random
import time

import pagedattn.memory.block_manager as bm
from pagedattn.repro.experiments import shared_prefix
from pagedattn.memory.block_manager import block_hashes
from pagedattn.repro.report.results import hardware_label, today, write_benchmark


def python_hash_chain(token_ids, block_size: int, num_blocks: int, parent: int | None = None) -> list[int]:
    """The replaced identity: ``h_i = hash((h_{i-1}, tuple(tokens of block i)))`` (Python's ``hash``)."""
    out = []
    for i in range(num_blocks):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out


SYSTEMS = {"python_hash": python_hash_chain, "blake2b_digest": block_hashes}


def time_per_block(fn, tokens: list[int], block_size: int, number: int) -> float:
    """Seconds per block for hashing every full block of ``tokens`` (mean over ``number`` calls)."""
    n = len(tokens) // block_size
    t0 = time.perf_counter()
    for _ in range(number):
        fn(tokens, block_size, n)
    return (time.perf_counter() - t0) / (number * n)


def time_simulation(num_requests: int, repeats: int) -> dict:
    """Wall seconds of notebook 07's offline paper-scale simulation (``paged_auto``, five-shot prefix) with each
    identity swapped into the block manager, interleaved, best of ``repeats``."""
    reqs = shared_prefix.make_requests(shared_prefix.SHOTS["five_shot"], num_requests, seed=0)
    best = {k: float("inf") for k in SYSTEMS}
    try:
        for _ in range(repeats):
            for name, fn in SYSTEMS.items():
                bm.block_hashes = fn
                t0 = time.perf_counter()
                shared_prefix.simulate_prefix(reqs, "paged_auto")
                best[name] = min(best[name], time.perf_counter() - t0)
    finally:
        bm.block_hashes = block_hashes
    return {"num_requests": num_requests, "seconds": best,
            "digest_over_python_hash": best["blake2b_digest"] / best["python_hash"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--num-tokens", type=int, default=2048, help="prompt length hashed per call (paper: max 2048)")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved rounds; the best round of each is kept")
    ap.add_argument("--sim-requests", type=int, default=200, help="requests in the notebook-07 simulation (0: skip)")
    ap.add_argument("--quick", action="store_true", help="block size 16, 2 rounds; writes nothing unless --out")
    ap.add_argument("--out", default=None, help="JSON path (default: results/benchmarks/prefix_hash.json)")
    a = ap.parse_args(argv)
    if a.quick:
        a.block_sizes, a.repeats, a.sim_requests = [16], 2, 0
    load_before = os.getloadavg()[0]
    tokens = [random.Random(0).randrange(50272) for _ in range(a.num_tokens)]  # OPT's vocabulary size
    rows = []
    for bs in a.block_sizes:
        number = max(1, 20_000 // (a.num_tokens // bs))  # about 20K blocks per timed call
        best = {k: float("inf") for k in SYSTEMS}
        for _ in range(a.repeats):
            for name, fn in SYSTEMS.items():
                best[name] = min(best[name], time_per_block(fn, tokens, bs, number))
        us = {k: 1e6 * v for k, v in best.items()}
        row = {"block_size": bs, "us_per_block": us,
               "digest_over_python_hash": us["blake2b_digest"] / us["python_hash"],
               "us_per_prompt": {k: v * (a.num_tokens // bs) for k, v in us.items()}}
        rows.append(row)
        print(f"block {bs:4d}: python hash {us['python_hash']:7.3f} us/block | BLAKE2b digest "
              f"{us['blake2b_digest']:7.3f} us/block | ratio {row['digest_over_python_hash']:.2f}x | a "
              f"{a.num_tokens}-token prompt: {row['us_per_prompt']['blake2b_digest']:.0f} us", flush=True)
    sim = time_simulation(a.sim_requests, 3) if a.sim_requests else None
    if sim:
        print(f"notebook 07 simulation ({a.sim_requests} requests, automatic prefix caching): "
              f"{sim['seconds']['blake2b_digest']:.2f} s with the digest, {sim['seconds']['python_hash']:.2f} s with "
              f"Python's hash ({sim['digest_over_python_hash']:.2f}x)", flush=True)
    summary = {"benchmark": "prefix_hash", "date": today(), "hardware": hardware_label("cpu"), "kind": "tracking",
               "what": "time to identify every full block of one prompt for the prefix cache",
               "systems": {"python_hash": "hash((parent, tuple(block tokens))), the replaced identity",
                           "blake2b_digest": "hashlib.blake2b(parent digest + int64 token bytes, digest_size=32)"},
               "num_tokens": a.num_tokens, "repeats": a.repeats,
               "timing": "time.perf_counter, systems interleaved per round, best round of each kept",
               "load_average_1min": {"before": load_before, "after": os.getloadavg()[0],
                                     "note": "other processes share the CPU: the ratio, interleaved within one run, "
                                             "is the number to read, not the absolute microseconds"},
               "rows": rows, "simulation_07_offline_five_shot_paged_auto": sim}
    write_benchmark(summary, "prefix_hash", a.out, a.quick)
    return summary


if __name__ == "__main__":
    main()
