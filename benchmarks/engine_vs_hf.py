"""Our engine vs Hugging Face ``generate()`` and HF continuous batching, side by side, next to this machine's limit.

All three systems run the same random-weight tiny Llama (GQA) on the same random-token prompts with greedy decoding,
EOS ignored, one torch thread. Two workloads:

- **fixed**: at each batch size ``B``, ``B`` prompts (real ShareGPT prompt lengths within ``--prompt-len``), each
  generating exactly ``--output-len`` tokens: our ``LLM`` with ``max_num_seqs = B``; HF ``generate()`` on one
  left-padded static batch (its contiguous KV cache); HF's continuous batching (``generate_batch``).
- **variable** (``--var-requests``): real ShareGPT (prompt, output) length pairs, each request with its own
  ``max_tokens``, at most ``--var-batch`` at once. This is where iteration-level batching matters (§4.5, §6.1):
  HF ``generate()`` runs static batches of ``--var-batch`` requests in order, each until its longest output.

The same run measures this machine's limits on one thread (copy bandwidth over a buffer larger than the L2, fp32
matmul GFLOP/s) at the start of every repeat (they drift on a shared host: 8.4-13.5 GB/s within one afternoon), and
from each repeat's, each decode step's roofline in that repeat: ``max(bytes / bandwidth, FLOPs / GFLOP/s)`` with
bytes = the weights read (every linear layer and the LM head, plus the batch's embedding rows) + the K/V read
(every context token, every layer) and FLOPs = ``2 x batch x linear parameters`` + attention. Ours is reported as a
multiple of it per decode step; HF ``generate()``'s decode step is ``(t(N tokens) - t(1 token)) / (N - 1)``.

Timing: every system runs ``--repeats`` times, interleaved (ours, generate, continuous batching, ours, ...), after a
warm-up. Times are process CPU seconds (all threads, so HF's background batching thread counts; ours and
``generate()`` use one thread), which other processes on a shared machine disturb less than the wall clock; wall
seconds are kept beside them. Ratios are taken within each repeat (interleaved pairs) and reported as the median with
min-max spread over repeats. The 1-minute load average is recorded before, during and after.

    .venv/bin/python benchmarks/engine_vs_hf.py            # writes results/benchmarks/engine_vs_hf.json
    .venv/bin/python benchmarks/engine_vs_hf.py --quick    # a smoke run (not written unless --out is given)
    .venv/bin/python benchmarks/engine_vs_hf.py --compare A.json B.json   # two runs' headline figures side by side
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from pagedattn import kernels
from pagedattn.llm import LLM
from pagedattn.repro.report.results import REPO_ROOT, hardware_label, today
from pagedattn.sequence import SamplingParams

MODEL = dict(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024, initializer_range=0.2)
TRACE = "sharegpt"  # pagedattn.repro.workloads.traces: real ShareGPT lengths (cl100k tokens)
TRACE_FALLBACK = "sharegpt_synthetic"  # synthetic lengths matched to the paper's Fig. 11, used only with --synthetic


def make_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL)).eval()


def length_pairs(n: int, prompt_len: tuple[int, int], max_total: int, seed: int, trace: str) -> list[tuple[int, int]]:
    """``n`` (prompt, output) length pairs of ``trace``, kept where the prompt is within ``prompt_len`` and
    prompt + output fits ``max_total`` (the model's positions)."""
    from pagedattn.repro.workloads.traces import sample_lengths

    p, o = sample_lengths(trace, 40 * n + 200, seed=seed)
    pairs = [(int(a), int(b)) for a, b in zip(p, o) if prompt_len[0] <= a <= prompt_len[1] and a + b <= max_total]
    if len(pairs) < n:
        raise ValueError(f"only {len(pairs)} {trace} requests with prompt in {prompt_len} and total <= {max_total}")
    return pairs[:n]


def random_prompts(lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, MODEL["vocab_size"], (k,), generator=g).tolist() for k in lens]


# ------------------------------------------------------------------------------------------------ the limit
def median_thread_time(fn, repeats: int) -> float:
    """Median thread CPU seconds of ``fn()`` over ``repeats`` calls, after one warm-up call."""
    fn()
    ts = []
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        ts.append(time.thread_time() - t)
    return statistics.median(ts)


def measure_machine(copy_mib: int = 64, repeats: int = 9) -> dict:
    """This machine's limits on the calling thread, measured now (thread CPU time, median of ``repeats``): copy
    bandwidth in bytes moved (read + written) per second over ``copy_mib`` MiB, and fp32 matmul GFLOP/s on a
    compute-bound ``[256, 1024] x [1024, 1024]`` product."""
    n = copy_mib << 18  # float32 elements
    src, dst = torch.randn(n), torch.empty(n)
    t_copy = median_thread_time(lambda: dst.copy_(src), repeats)
    x, w = torch.randn(256, 1024), torch.randn(1024, 1024)
    t_mm = median_thread_time(lambda: torch.mm(x, w), repeats)
    return {"copy_gb_per_s": 2 * n * 4 / t_copy / 1e9, "matmul_gflop_per_s": 2 * 256 * 1024 * 1024 / t_mm / 1e9,
            "copy_buffer_mib": copy_mib, "threads": torch.get_num_threads(), "timing": "thread CPU time, median"}


def model_costs(model) -> dict:
    """Per-token weight and K/V sizes of ``model`` (fp32) for the roofline."""
    cfg = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return {"linear_params": linear, "norm_params": norms, "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers,
            "heads": cfg.num_attention_heads, "head_dim": head_dim, "elem": 4,
            "kv_bytes_per_token": 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4}


def decode_roofline(costs: dict, machine: dict, batch: int, context_tokens: int) -> dict:
    """Lower bound on one decode step of ``batch`` sequences holding ``context_tokens`` K/V tokens in all: the larger
    of its bytes over the copy bandwidth and its FLOPs over the matmul rate."""
    c = costs
    weight_bytes = c["elem"] * (c["linear_params"] + c["norm_params"] + batch * c["hidden"])
    kv_bytes = context_tokens * c["kv_bytes_per_token"]
    flops = 2 * batch * c["linear_params"] + 4 * c["layers"] * c["heads"] * c["head_dim"] * context_tokens
    t_mem = (weight_bytes + kv_bytes) / (machine["copy_gb_per_s"] * 1e9)
    t_flop = flops / (machine["matmul_gflop_per_s"] * 1e9)
    return {"seconds": max(t_mem, t_flop), "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "flops": flops,
            "bound": "memory" if t_mem >= t_flop else "compute"}


def prefill_roofline(costs: dict, machine: dict, prompt_lens: list[int]) -> float:
    """Lower bound on computing every prompt once: FLOPs (linear layers and causal attention) over the matmul rate,
    or the weights and the K/V written over the bandwidth, whichever is larger."""
    c, tokens = costs, sum(prompt_lens)
    flops = 2 * tokens * c["linear_params"] + 2 * c["layers"] * c["heads"] * c["head_dim"] * sum(
        p * (p + 1) for p in prompt_lens)
    bytes_ = c["elem"] * (c["linear_params"] + tokens * c["hidden"]) + tokens * c["kv_bytes_per_token"]
    return max(flops / (machine["matmul_gflop_per_s"] * 1e9), bytes_ / (machine["copy_gb_per_s"] * 1e9))


# ------------------------------------------------------------------------------------------------ the systems
def run_ours(llm: LLM, prompts, out_lens: list[int]) -> dict:
    """Drive the engine step by step, timing each step in thread CPU time."""
    engine = llm.engine
    engine.step_metrics.clear()
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        engine.add_request(f"b{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    outputs, step_cpu = {}, []
    c0, w0 = time.process_time(), time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.thread_time()
        for o in engine.step(finished_only=True):
            if o.finished:
                outputs[o.request_id] = o.outputs[0].token_ids
        step_cpu.append(time.thread_time() - t)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    steps = [(m.kind, m.batch_size, m.slots_filled, m.forward_time, m.step_time, c)
             for m, c in zip(engine.step_metrics, step_cpu)]
    return {"cpu": cpu, "wall": wall, "tokens": [outputs[f"b{i}"] for i in range(len(prompts))], "steps": steps}


@torch.inference_mode()
def run_hf_generate(hf, prompts, out_len: int) -> dict:
    """One left-padded static batch generating exactly ``out_len`` tokens per prompt."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    c0, w0 = time.process_time(), time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return {"cpu": time.process_time() - c0, "wall": time.perf_counter() - w0, "tokens": out[:, width:].tolist()}


def run_hf_static(hf, prompts, out_lens: list[int], batch: int) -> dict:
    from pagedattn.baselines.hf import generate_static

    r = generate_static(hf, prompts, out_lens, batch)
    return {"cpu": r["seconds"], "wall": r["wall_seconds"], "tokens": r["outputs"]}


def run_hf_cb(hf, prompts, out_lens: list[int], batch: int) -> dict:
    from pagedattn.baselines.hf import continuous_batching

    pages = batch * -(-max(len(p) + n for p, n in zip(prompts, out_lens)) // 64) + 4
    r = continuous_batching(hf, prompts, out_lens, num_slots=pages * 64, max_requests=batch, page_size=64)
    return {"cpu": r["seconds"], "wall": r["wall_seconds"], "tokens": r["outputs"]}


# ------------------------------------------------------------------------------------------------ statistics
def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def load1() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def tokens_equal(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def bench_fixed(hf, costs, machine, batch: int, a, loads: list) -> dict:
    pairs = length_pairs(batch, a.prompt_len, MODEL["max_position_embeddings"] - a.output_len, batch, a.trace)
    prompts = random_prompts([p for p, _ in pairs], seed=batch)
    out_lens = [a.output_len] * batch
    llm = LLM(hf, max_num_seqs=batch)
    # the same engine with the torch reference attention (gather by block table + SDPA): the C++ kernel's gain
    llm_torch = LLM(hf, max_num_seqs=batch, attention_backend="torch") if llm.engine.backend.name != "torch" else None
    warm = prompts[: min(4, batch)]
    run_ours(llm, warm, [4] * len(warm))
    if llm_torch is not None:
        run_ours(llm_torch, warm, [4] * len(warm))
    run_hf_generate(hf, warm, 4)
    if not a.no_cb:
        run_hf_cb(hf, warm, [4] * len(warm), len(warm))
    reps = []
    for _ in range(a.repeats):
        r = {"machine": measure_machine(), "ours": run_ours(llm, prompts, out_lens),
             "hf_generate": run_hf_generate(hf, prompts, a.output_len), "hf_generate_1": run_hf_generate(hf, prompts, 1)}
        if llm_torch is not None:
            r["ours_torch_attention"] = run_ours(llm_torch, prompts, out_lens)
        if not a.no_cb:
            r["hf_continuous_batching"] = run_hf_cb(hf, prompts, out_lens, batch)
        reps.append(r)
        loads.append(load1())
    return summarise(reps, costs, machine, prompts, batch, fixed_out=a.output_len)


def bench_variable(hf, costs, machine, a, loads: list) -> dict:
    batch = a.var_batch
    pairs = length_pairs(a.var_requests, a.prompt_len, MODEL["max_position_embeddings"], 7, a.trace)
    prompts = random_prompts([p for p, _ in pairs], seed=7)
    out_lens = [o for _, o in pairs]
    llm = LLM(hf, max_num_seqs=batch)
    run_ours(llm, prompts[:2], [4, 4])
    reps = []
    for _ in range(a.var_repeats):
        r = {"machine": measure_machine(), "ours": run_ours(llm, prompts, out_lens),
             "hf_generate": run_hf_static(hf, prompts, out_lens, batch)}
        if not a.no_cb:
            r["hf_continuous_batching"] = run_hf_cb(hf, prompts, out_lens, batch)
        reps.append(r)
        loads.append(load1())
    row = summarise(reps, costs, machine, prompts, batch)
    row["output_len"] = {"mean": sum(out_lens) / len(out_lens), "min": min(out_lens), "max": max(out_lens),
                         "static_batch_longest_mean": statistics.mean(
                             max(out_lens[i:i + batch]) for i in range(0, len(out_lens), batch))}
    row["num_requests"] = len(prompts)
    return row


def summarise(reps: list[dict], costs, machine, prompts, batch: int, fixed_out: int | None = None) -> dict:
    systems = [k for k in ("ours", "hf_generate", "hf_continuous_batching", "ours_torch_attention") if k in reps[0]]
    useful = sum(len(t) for t in reps[0]["ours"]["tokens"])
    plens = [len(p) for p in prompts]
    # the run's roofline: one prefill of every prompt + our engine's decode steps (its batches and contexts, the same
    # in every repeat), at the machine's limits measured at the start of each repeat (they drift on a shared host)
    steps = reps[0]["ours"]["steps"]

    def roof_run(m: dict) -> float:
        return prefill_roofline(costs, m, plens) + sum(decode_roofline(costs, m, b, ctx)["seconds"]
                                                         for kind, b, ctx, *_ in steps if kind == "decode")
    roofs = [roof_run(r["machine"]) for r in reps]
    row = {"batch_size": batch, "num_prompts": len(prompts), "generated_tokens": useful,
           "prompt_len": {"mean": sum(plens) / len(plens), "min": min(plens), "max": max(plens)},
           "machine_per_repeat": [{k: r["machine"][k] for k in ("copy_gb_per_s", "matmul_gflop_per_s")} for r in reps],
           "roofline_run_seconds": spread(roofs),
           "tokens_per_cpu_s": {k: spread([useful / r[k]["cpu"] for r in reps]) for k in systems},
           "tokens_per_wall_s": {k: spread([useful / r[k]["wall"] for r in reps]) for k in systems},
           "run_roofline_multiple": {k: spread([r[k]["cpu"] / x for r, x in zip(reps, roofs)]) for k in systems},
           "speedup_cpu": {f"vs_{k}": spread([r[k]["cpu"] / r["ours"]["cpu"] for r in reps]) for k in systems[1:]},
           "speedup_wall": {f"vs_{k}": spread([r[k]["wall"] / r["ours"]["wall"] for r in reps]) for k in systems[1:]},
           "tokens_equal_hf_generate": min(tokens_equal(r["ours"]["tokens"], r["hf_generate"]["tokens"]) for r in reps),
           # every system against HF generate (its worst repeat): how often HF's own two paths agree shows what a
           # different attention kernel's rounding may flip on near-ties
           "tokens_equal_vs_hf_generate": {k: min(tokens_equal(r[k]["tokens"], r["hf_generate"]["tokens"])
                                                  for r in reps) for k in systems if k != "hf_generate"}}
    # our decode steps at the full batch: CPU time per step over its roofline; engine share outside the forward
    full = [[(cpu, decode_roofline(costs, r["machine"], b, ctx)["seconds"], fwd, st)
             for kind, b, ctx, fwd, st, cpu in r["ours"]["steps"] if kind == "decode" and b == batch] for r in reps]
    if full[0]:
        row["ours_full_batch_decode"] = {
            "steps_per_run": len(full[0]),
            "step_ms": spread([1e3 * statistics.median(c for c, *_ in f) for f in full]),
            "roofline_ms": 1e3 * statistics.median(statistics.median(x for _, x, *_ in f) for f in full),
            "roofline_multiple": spread([statistics.median(c / x for c, x, *_ in f) for f in full]),
            "outside_forward_share": spread([1 - sum(x[2] for x in f) / sum(x[3] for x in f) for f in full])}
        bound = decode_roofline(costs, machine, batch, steps[-1][2])["bound"]
        row["ours_full_batch_decode"]["bound_at_last_step"] = bound
    if fixed_out is not None and fixed_out > 1:  # HF generate's decode step from two runs of the same batch
        hf_step = [(r["hf_generate"]["cpu"] - r["hf_generate_1"]["cpu"]) / (fixed_out - 1) for r in reps]
        row["hf_generate_decode"] = {"step_ms": spread([1e3 * x for x in hf_step]),
                                     "roofline_multiple": spread([x / statistics.median(y for _, y, *_ in f)
                                                                  for x, f in zip(hf_step, full)])}
    return row


def fmt(s: dict | None, unit: str = "x") -> str:
    return "n/a" if s is None else f"{s['median']:.2f}{unit} [{s['min']:.2f}-{s['max']:.2f}]"


def agree(row: dict) -> str:
    return ", ".join(f"{k} {100 * v:.1f}%" for k, v in row["tokens_equal_vs_hf_generate"].items())


REPRODUCE_WITHIN = 0.15  # issue 17: a rerun reproduces the ratios within 15 %


def compare(a_path: str, b_path: str) -> dict:
    """Two runs' headline figures side by side: each figure's relative difference (B / A - 1) and whether it is
    within ``REPRODUCE_WITHIN``; the token agreement is compared as is."""
    a, b = (json.loads(Path(x).read_text())["headline"] for x in (a_path, b_path))
    rows = {}
    for k in a.keys() & b.keys():
        diff = b[k] / a[k] - 1 if a[k] else float("inf")
        rows[k] = {"a": a[k], "b": b[k], "relative_difference": diff, "within": abs(diff) <= REPRODUCE_WITHIN}
    for k, r in sorted(rows.items()):
        print(f"{k:55s} {r['a']:8.3f} {r['b']:8.3f} {100 * r['relative_difference']:+6.1f} % "
              f"{'ok' if r['within'] else 'OUTSIDE'} {100 * REPRODUCE_WITHIN:.0f} %")
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[4, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=64, help="fixed mode: new tokens per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--var-requests", type=int, default=128, help="variable mode: requests (0: skip the mode)")
    ap.add_argument("--var-batch", type=int, default=64, help="variable mode: max requests at once")
    ap.add_argument("--var-repeats", type=int, default=3)
    ap.add_argument("--synthetic", action="store_true",
                    help=f"lengths from the synthetic {TRACE_FALLBACK!r} trace instead of real ShareGPT")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for every system (default 1: on a shared 2-core VM, 2 threads "
                         "stall on each other's barriers whenever another process holds a core)")
    ap.add_argument("--no-cb", action="store_true", help="skip HF continuous batching")
    ap.add_argument("--quick", action="store_true", help="batch 8 and 16, 16 new tokens, 2 repeats, 32 var requests")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="print two runs' headline figures side by side "
                                                                    "and exit")
    ap.add_argument("--out", default=None, help="JSON path (default: results/benchmarks/engine_vs_hf.json; "
                                                "--quick writes nothing unless given)")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    a.trace = TRACE_FALLBACK if a.synthetic else TRACE
    if a.quick:
        a.batch_sizes, a.output_len, a.repeats, a.var_requests, a.var_batch, a.var_repeats = [8, 16], 16, 2, 32, 16, 1
    torch.set_num_threads(a.threads)
    loads = [load1()]
    machine = measure_machine()
    hf = make_model()
    costs = model_costs(hf)
    rows = []
    for batch in a.batch_sizes:
        row = bench_fixed(hf, costs, machine, batch, a, loads)
        rows.append(row)
        write(a, machine, costs, loads, rows, None, complete=False)
        d = row.get("ours_full_batch_decode", {})
        print(f"fixed batch {batch:3d}: ours {fmt(row['tokens_per_cpu_s']['ours'], ' tok/cpu-s')} | speedup vs HF "
              f"generate {fmt(row['speedup_cpu']['vs_hf_generate'])} | vs HF continuous batching "
              f"{fmt(row['speedup_cpu'].get('vs_hf_continuous_batching'))} | vs ours with torch attention "
              f"{fmt(row['speedup_cpu'].get('vs_ours_torch_attention'))} | decode step "
              f"{fmt(d.get('step_ms'), ' ms')} = {fmt(d.get('roofline_multiple'))} roofline "
              f"({d.get('roofline_ms', float('nan')):.2f} ms), HF generate {fmt(row['hf_generate_decode']['roofline_multiple'])} | "
              f"tokens equal HF: {100 * row['tokens_equal_hf_generate']:.0f}% (all: {agree(row)})", flush=True)
    var = None
    if a.var_requests:
        var = bench_variable(hf, costs, machine, a, loads)
        print(f"variable ({var['num_requests']} requests, batch {a.var_batch}, outputs mean "
              f"{var['output_len']['mean']:.0f} max {var['output_len']['max']}): speedup vs HF generate static "
              f"{fmt(var['speedup_cpu']['vs_hf_generate'])} | vs HF continuous batching "
              f"{fmt(var['speedup_cpu'].get('vs_hf_continuous_batching'))} | run roofline multiple ours "
              f"{fmt(var['run_roofline_multiple']['ours'])} | tokens equal HF: "
              f"{100 * var['tokens_equal_hf_generate']:.0f}% (all: {agree(var)})", flush=True)
    return write(a, machine, costs, loads + [load1()], rows, var, complete=True)


# Targets of issue 17, set before any run: (what, median must be at most / at least)
TARGETS = {"decode_roofline_multiple.batch64": ("<=", 2.0), "decode_roofline_multiple.batch8": ("<=", 3.0),
           "speedup_vs_hf_generate.batch8": (">=", 1.5), "speedup_vs_hf_generate.batch64": (">=", 1.5),
           "speedup_vs_hf_continuous_batching.batch8": (">=", 3.0),
           "speedup_vs_hf_continuous_batching.batch64": (">=", 3.0),
           "variable.speedup_vs_hf_generate_static": (">=", 4.0), "tokens_equal_hf_generate": (">=", 1.0)}


def headline(rows: list[dict], var: dict | None) -> dict:
    """The figures the targets name (medians over repeats; CPU-time speedups)."""
    h = {}
    for r in rows:
        b = r["batch_size"]
        if "ours_full_batch_decode" in r:
            h[f"decode_roofline_multiple.batch{b}"] = r["ours_full_batch_decode"]["roofline_multiple"]["median"]
        for k, v in r["speedup_cpu"].items():
            h[f"speedup_{k}.batch{b}"] = v["median"]
    if var is not None:
        h["variable.speedup_vs_hf_generate_static"] = var["speedup_cpu"]["vs_hf_generate"]["median"]
        if "vs_hf_continuous_batching" in var["speedup_cpu"]:
            h["variable.speedup_vs_hf_continuous_batching"] = var["speedup_cpu"]["vs_hf_continuous_batching"]["median"]
        h["variable.run_roofline_multiple"] = var["run_roofline_multiple"]["ours"]["median"]
    h["tokens_equal_hf_generate"] = min(r["tokens_equal_hf_generate"] for r in rows + ([var] if var else []))
    return h


def write(a, machine, costs, loads, rows, var, complete: bool) -> dict:
    """The summary so far (written after every workload, so that a run cut short keeps what it measured)."""
    import transformers

    from pagedattn.repro.workloads.traces import describe_trace

    summary = {"benchmark": "engine_vs_hf", "date": today(), "hardware": hardware_label("cpu"),
               "torch": torch.__version__, "transformers": transformers.__version__,
               "torch_threads": torch.get_num_threads(), "machine": machine,
               "model": {"arch": "LlamaForCausalLM (random weights)", "dtype": "float32", **MODEL, **costs},
               "workload": {"trace": describe_trace(a.trace), "prompt_len_bounds": a.prompt_len,
                            "fixed_output_len": a.output_len, "decoding": "greedy, ignore_eos",
                            "repeats": a.repeats, "var_repeats": a.var_repeats,
                            "timing": "process CPU seconds (wall beside), systems interleaved within each repeat; "
                                      "median [min-max] over repeats; speedups are per-repeat ratios"},
               "roofline": "per decode step max(bytes / copy bandwidth, FLOPs / matmul rate), at the limits measured "
                           "at the start of each repeat (machine: the run's first measurement); bytes = weights "
                           "(linear layers, norms, batch embedding rows) + K/V of every context token; the run's "
                           "roofline adds one prefill of every prompt to our engine's decode steps",
               "engine": {"block_size": 16, "attention_backend": kernels.get_backend("auto").name,
                          "max_num_seqs": "= batch size"},
               "load_average_1min": {"samples": loads, "max": max(x for x in loads if x is not None) if any(loads)
                                     else None,
                                     "note": "other processes share the 2 cores; CPU-time ratios interleaved within a "
                                             "run are comparable, absolute rates across runs are not"},
               "complete": complete, "headline": (h := headline(rows, var)),
               "targets": {k: {"rule": f"{op} {x}", "ours": h.get(k),
                               "met": None if h.get(k) is None else (h[k] <= x if op == "<=" else h[k] >= x)}
                           for k, (op, x) in TARGETS.items()},
               "fixed": rows, "variable": var}
    out = a.out or (None if a.quick else REPO_ROOT / "results" / "benchmarks" / "engine_vs_hf.json")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {out}")
    return summary


if __name__ == "__main__":
    main()
