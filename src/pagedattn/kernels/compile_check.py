"""Compile every Triton kernel for sm_80 and sm_90 without a GPU, and check its resources (§4.1, §5.1).

Each *case* (kernel, dtype, head dim, GQA group, block size, split-KV or not) builds ``meta`` tensors (shapes and
strides, no memory) and asks the wrappers' own launch plans (:func:`~pagedattn.kernels.paged_attention.
plan_paged_attention` and friends) for their launches, so the constexprs, warps and stages compiled here are those
a real launch uses. Each launch is compiled for each target by :mod:`pagedattn.kernels.aot`, and checked:

- it compiles (down to a cubin, with the ptxas in the triton wheel);
- shared memory within the target's per-block limit;
- registers x threads within the register file (a block must fit on one SM);
- *engine* cases (fp16/bf16, head dims 64-128, block sizes 8-32: what the engine runs on a GPU) spill nothing.

Spills elsewhere are reported in the table, not failed.

Command line (the kernels must be defined compiled, so this sets ``TRITON_INTERPRET=0`` before importing them)::

    python -m pagedattn.kernels.compile_check            # quick grid (CI, ~1 minute on 2 cores)
    python -m pagedattn.kernels.compile_check --full --csv results/02_attention_kernel/compile_table.csv

The exit status is 1 if any check fails. :func:`run_subprocess` runs it from a process (tests, notebook) whose
kernels are interpreted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

TARGETS = (80, 90)
FAMILIES = ("attention", "reshape_and_cache", "copy_blocks", "rms_norm", "rope", "rope_and_cache")
#: families with a cache operand, compiled over block sizes 8-32 in the full grid
CACHE_FAMILIES = ("reshape_and_cache", "copy_blocks", "rope_and_cache")
#: query heads of the layer-op cases (RMSNorm over 32 x head_dim, RoPE over 32 query + 8 kv heads)
LAYER_HEADS = 32
DTYPES = ("float16", "bfloat16", "float32")
#: tokens per sequence in the attention cases (the block table's capacity; 4 partitions of 512 when split)
CONTEXT = 2000
NUM_SEQS = 8
NUM_KV_HEADS = 8


@dataclass(frozen=True)
class Case:
    """One configuration of one kernel family."""

    family: str
    dtype: str
    head_dim: int
    block_size: int
    group: int = 1  # query heads per kv head (attention)
    split: bool = False  # split-KV path (attention)

    @property
    def engine(self) -> bool:
        """A configuration the engine runs on a GPU: these must not spill."""
        return self.dtype in ("float16", "bfloat16") and 64 <= self.head_dim <= 128 and 8 <= self.block_size <= 32


def grid(full: bool) -> list[Case]:
    """The full grid (``make kernels-compile``) or the quick one (CI): the engine's configurations at block 16 in
    both dtypes, MHA and GQA 4, both split modes, head dims 64 and 128; block sizes 8 and 32; one padded head dim
    (80) and one fp32 case; the cache write, block copy, RMSNorm, RoPE, and RoPE with the cache write (also at head
    dims 64 / 128 with blocks 8 / 32)."""
    if full:
        att = [Case("attention", dt, hd, bs, g, sp) for dt in DTYPES for hd in (64, 80, 96, 128)
               for bs in (1, 2, 4, 8, 16, 32, 64, 128, 256) for g in (1, 4) for sp in (False, True)]
        aux = [Case(f, dt, hd, bs) for f in CACHE_FAMILIES for dt in DTYPES for hd in (64, 80, 96, 128)
               for bs in (8, 16, 32)]
        aux += [Case(f, dt, hd, 16) for f in ("rms_norm", "rope") for dt in DTYPES for hd in (64, 80, 96, 128)]
        return att + aux
    att = [Case("attention", dt, hd, 16, g, sp) for dt in ("float16", "bfloat16") for hd in (64, 128)
           for g in (1, 4) for sp in (False, True)]
    att += [Case("attention", "float16", 128, bs, g, False) for bs in (8, 32) for g in (1, 4)]
    att += [Case("attention", "bfloat16", 80, 16, 4, True), Case("attention", "float32", 128, 16, 4, False)]
    aux = [Case(f, "float16", 128, 16) for f in FAMILIES[1:]]
    aux += [Case("rope_and_cache", "bfloat16", 64, 8), Case("rope_and_cache", "bfloat16", 128, 32)]
    return att + aux


def case_launches(case: Case) -> list:
    """The launches the wrapper would make for ``case``, on meta tensors: ``[(name, Launch), ...]``."""
    import torch

    from pagedattn.kernels import paged_attention as pa

    dt = getattr(torch, case.dtype)
    meta: dict[str, Any] = dict(device="meta")
    kvh, d, bs = NUM_KV_HEADS, case.head_dim, case.block_size
    width = -(-CONTEXT // bs)
    cache = lambda: torch.empty(NUM_SEQS * width, bs, kvh, d, dtype=dt, **meta)  # noqa: E731
    if case.family == "attention":
        q = torch.empty(NUM_SEQS, kvh * case.group, d, dtype=dt, **meta)
        launches = pa.plan_paged_attention(
            q, cache(), cache(), torch.empty(NUM_SEQS, width, dtype=torch.int32, **meta),
            torch.empty(NUM_SEQS, dtype=torch.int32, **meta), d ** -0.5, torch.empty_like(q), split_kv=case.split)
        return [(launch.kernel.__name__.strip("_").removesuffix("_kernel"), launch) for launch in launches]
    if case.family == "reshape_and_cache":
        k = torch.empty(NUM_SEQS, kvh, d, dtype=dt, **meta)
        return [("reshape_and_cache", pa.plan_reshape_and_cache(
            k, torch.empty_like(k), cache(), cache(), torch.empty(NUM_SEQS, dtype=torch.long, **meta)))]
    if case.family == "copy_blocks":
        return [("copy_blocks", pa.plan_copy_blocks(cache(), cache(), torch.empty(4, 2, dtype=torch.long, **meta)))]
    if case.family in ("rms_norm", "rope", "rope_and_cache"):
        from pagedattn.kernels import fused_layer as fl

        if case.family == "rms_norm":
            x = torch.empty(NUM_SEQS, LAYER_HEADS * d, dtype=dt, **meta)
            return [("rms_norm", fl.plan_rms_norm(x, torch.empty(x.shape[1], dtype=dt, **meta), 1e-6, out=x,
                                                  residual=torch.empty_like(x)))]
        qk = torch.empty(NUM_SEQS, LAYER_HEADS + kvh, d, dtype=dt, **meta)
        cs = torch.empty(NUM_SEQS, 1, d, dtype=dt, **meta)
        if case.family == "rope":
            return [("rope", fl.plan_rope(qk, cs, cs))]
        v = torch.empty(NUM_SEQS, kvh, d, dtype=dt, **meta)
        return [("rope_and_cache", fl.plan_rope_and_cache(qk, v, cs, cs, cache(), cache(),
                                                          torch.empty(NUM_SEQS, dtype=torch.long, **meta)))]
    raise ValueError(f"unknown kernel family {case.family!r}; choose one of {FAMILIES}")


def _variant_key(launch, arch: int) -> str:
    """Two launches with equal keys compile to the same binary: compile once."""
    from pagedattn.kernels.aot import source

    src = source(launch.kernel, launch.args, launch.constexprs)
    return repr((src.name, sorted(src.signature.items()), sorted(src.constants.items()), sorted(src.attrs.items()),
                 launch.num_warps, launch.num_stages, launch.fp_fusion, arch))


def _compile_one(job: tuple[Case, int, int]) -> dict:
    """Worker: compile launch ``index`` of ``case`` for ``arch``; a compiler error becomes the row's ``error``."""
    from pagedattn.kernels.aot import compile_launch

    case, index, arch = job
    _, launch = case_launches(case)[index]
    t0 = time.perf_counter()
    try:
        stats = compile_launch(launch.kernel, launch.args, launch.constexprs, launch.num_warps, launch.num_stages,
                               arch, enable_fp_fusion=launch.fp_fusion)
        row = asdict(stats)
        row.pop("kernel")
        row["error"] = ""
    except Exception as e:  # noqa: BLE001 - a failed compile is a result to report
        row = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"}
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    return row


def _problems(row: dict) -> str:
    from pagedattn.kernels.aot import MAX_REGS_PER_THREAD, REGISTER_FILE, SHARED_LIMIT

    if row.get("error"):
        return f"compile failed: {row['error']}"
    out = []
    if row["shared"] > SHARED_LIMIT[row["arch"]]:
        out.append(f"shared memory {row['shared']} B > {SHARED_LIMIT[row['arch']]} B")
    if row["registers"] > MAX_REGS_PER_THREAD or row["registers"] * 32 * row["num_warps"] > REGISTER_FILE:
        out.append(f"{row['registers']} registers x {32 * row['num_warps']} threads > {REGISTER_FILE}")
    if row["engine"] and (row["spill_stores"] or row["spill_loads"]):
        out.append(f"engine configuration spills {row['spill_stores']} B stores / {row['spill_loads']} B loads")
    return "; ".join(out)


def check(cases: list[Case], targets=TARGETS, jobs: int = 1, progress: bool = False):
    """Compile every launch of every case for every target; returns the table (one row per case x launch x
    target) as a DataFrame with a ``problem`` column (empty when every check passes)."""
    import pandas as pd

    plans = [(case, i, name, launch) for case in cases for i, (name, launch) in enumerate(case_launches(case))]
    rows: list = []
    unique: dict = {}
    for arch in targets:
        for case, i, name, launch in plans:
            key = _variant_key(launch, arch)
            unique.setdefault(key, (case, i, arch))
            c = launch.constexprs
            rows.append(dict(target=f"sm_{arch}", kernel=name, **asdict(case), engine=case.engine,
                             tile=c.get("TILE_N", c.get("BLOCK_P", c.get("CHUNK"))), key=key))
    keys = list(unique)
    if progress:
        print(f"{len(rows)} launches, {len(keys)} distinct variants, {jobs} job(s)", flush=True)
    todo = [unique[k] for k in keys]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(jobs) if jobs > 1 else contextlib.nullcontext() as pool:
        results = []
        for res in (pool.map(_compile_one, todo, chunksize=1) if pool else map(_compile_one, todo)):
            results.append(res)
            if progress and len(results) % 100 == 0:
                print(f"  {len(results)}/{len(todo)} compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    by_key = dict(zip(keys, results))
    table = []
    for row in rows:
        res = dict(by_key[row.pop("key")])
        res.pop("arch", None)
        table.append(dict(row, arch=int(row["target"][3:]), **res))
    df = pd.DataFrame(table)
    df["problem"] = [_problems(r) for r in df.to_dict("records")]
    return df


def run_subprocess(full: bool = False, csv: Optional[Path] = None, jobs: Optional[int] = None,
                   timeout: Optional[float] = None):
    """Run the check in a fresh process (kernels compiled, not interpreted); returns ``(returncode, table)``."""
    import pandas as pd

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(csv) if csv else Path(tmp) / "table.csv"
        env = dict(os.environ, TRITON_INTERPRET="0")
        cmd = [sys.executable, "-m", "pagedattn.kernels.compile_check", "--csv", str(out)]
        cmd += ["--full"] if full else []
        cmd += ["--jobs", str(jobs)] if jobs else []
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if not out.exists():
            raise RuntimeError(f"compile check wrote no table (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc.returncode, pd.read_csv(out, keep_default_na=False)


def summarize(df):
    """Per target, kernel and dtype: the variants, how many spill (all, and engine configurations), the largest
    register count, spill and shared memory, and the warps / stages used."""
    d = df.assign(spills=(df.spill_stores > 0) | (df.spill_loads > 0),
                  engine_spills=((df.spill_stores > 0) | (df.spill_loads > 0)) & df.engine.astype(str).eq("True"))
    return (d.groupby(["target", "kernel", "dtype"])
            .agg(variants=("registers", "size"), spilling=("spills", "sum"), engine_spilling=("engine_spills", "sum"),
                 max_registers=("registers", "max"), max_spill_bytes=("spill_stores", "max"),
                 max_shared_kb=("shared", lambda x: round(x.max() / 1024, 1)),
                 warps=("num_warps", lambda x: "/".join(map(str, sorted(set(x))))),
                 stages=("num_stages", lambda x: "/".join(map(str, sorted(set(x))))),
                 failing=("problem", lambda x: int((x != "").sum())))
            .reset_index())


COLUMNS = ["target", "kernel", "family", "dtype", "head_dim", "group", "block_size", "split", "engine", "tile",
           "num_warps", "num_stages", "registers", "spill_stores", "spill_loads", "stack_frame", "shared",
           "compile_s", "error", "problem"]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedattn.kernels.compile_check", description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="the full grid (else the quick one)")
    ap.add_argument("--csv", type=Path, help="write the table here")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compile processes (default 2)")
    ap.add_argument("--targets", default=",".join(map(str, TARGETS)), help="compute capabilities, e.g. 80,90")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pagedattn-compile-") as cache:
        os.environ.setdefault("TRITON_CACHE_DIR", cache)  # every variant is compiled anew anyway (aot.py)
        df = check(grid(args.full), tuple(int(t) for t in args.targets.split(",")), args.jobs, progress=True)
    df = df[[c for c in COLUMNS if c in df]]
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(args.csv, index=False)
    bad = df[df.problem != ""]
    spills = df[(df.get("spill_stores", 0) > 0) | (df.get("spill_loads", 0) > 0)]
    print(f"{len(df)} launches compiled for {args.targets} in {time.perf_counter() - t0:.0f} s; "
          f"{len(spills)} spill ({int(spills.engine.sum())} engine configurations); {len(bad)} fail a check")
    for r in bad.to_dict("records"):
        print(f"  FAIL {r['target']} {r['kernel']} {r['dtype']} d{r['head_dim']} g{r['group']} bs{r['block_size']} "
              f"split={r['split']}: {r['problem']}")
    print(json.dumps({"launches": len(df), "spilling": len(spills), "failing": len(bad)}))
    return 1 if len(bad) else 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("pagedattn.kernels.compile_check compiles for a GPU: run it with TRITON_INTERPRET=0 (or unset)")
    os.environ["TRITON_INTERPRET"] = "0"  # the kernel module would switch the interpreter on without CUDA
    sys.exit(main())
