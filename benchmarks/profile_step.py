"""Where one decode step of our engine spends its time, part by part, for one configuration (§4.1, §4.5).

The engine runs ``engine_vs_hf``'s model and prompts at ``--batch`` until ``--warm-steps`` decode steps are done,
then times ``--steps`` decode steps (thread CPU time, median) and profiles as many more with ``torch.profiler``,
driven as the benchmark drives it (``step(finished_only=True)``). The profile is split into parts by the function
each torch op was called from (the attention kernel, the KV-cache write, the decode plan, the linear layers, the C++
per-layer operations, the rest of the forward) and by op within the attention kernel; the engine's own Python (scheduling, block tables, sampling, outputs) is what remains of the step outside the forward.
The profiler adds a few microseconds to every op, so its parts add up to more than the unprofiled step; the
shares are what to read. The step's roofline (``engine_vs_hf.decode_roofline``) and the linear layers' time run
standalone on the same shapes are printed beside.

    PYTHONPATH=src .venv/bin/python benchmarks/profile_step.py --batch 64 [--dtype bfloat16]

``--dtype bfloat16`` runs the model cast with ``.to(torch.bfloat16)`` (weights, K/V cache and the C++ kernels in
bf16); the roofline stays the fp32 one (fp32 bytes and matmul rate), a reference line, not bf16's bound.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from engine_vs_hf import (MODEL, TRACE, decode_roofline, length_pairs, make_model, measure_machine,
                          median_thread_time, model_costs, random_prompts)
from pagedattn.llm import LLM
from pagedattn.kernels import cpu
from pagedattn.sequence import SamplingParams

SCOPES = {"attention": "paged_attention", "kv write": "reshape_and_cache", "decode plan": "plan_decode",
          "forward": "forward", "prepare input": "prepare_input", "rms norm": "rms_norm_cpu", "rope": "rope_cpu",
          "argmax": "argmax_cpu"}
LAYER_OPS = ("rms_norm_cpu", "rope_cpu", "argmax_cpu")  # the C++ per-layer operations (kernels/cpu.py)
# the linear layers' ops: torch's GEMMs (fp32: MKL on Intel CPUs, and elsewhere below fused.ONEDNN_MIN_ROWS rows;
# bf16: oneDNN) and oneDNN's own linear op
MATMULS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::linear", "mkldnn::_linear_pointwise")


def scoped(name: str, fn):
    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return wrapper


def instrument(engine) -> None:
    """Label the runner's kernels and phases so the profile can be split by them."""
    r = engine.runner
    b = r.backend
    r.backend = replace(b, paged_attention=scoped("paged_attention", b.paged_attention),
                        reshape_and_cache=scoped("reshape_and_cache", b.reshape_and_cache),
                        plan_decode=b.plan_decode and scoped("plan_decode", b.plan_decode))
    r.forward = scoped("forward", r.forward)
    r.prepare_input = scoped("prepare_input", r.prepare_input)
    for name in LAYER_OPS:  # called as cpu.NAME by the model and the sampler: patch the module attribute
        setattr(cpu, name, scoped(name, getattr(cpu, name)))


def scope_of(event) -> str | None:
    e = event.cpu_parent
    while e is not None:
        if e.name in SCOPES.values():
            return e.name
        e = e.cpu_parent
    return None


def breakdown(prof, steps: int) -> tuple[dict[str, float], int]:
    """ms per step by part, and the number of top-level torch ops per step."""
    parts: dict[str, float] = defaultdict(float)
    top_ops = 0
    for e in prof.events():
        if e.name in SCOPES.values():
            if e.name == "forward":
                parts["forward (total)"] += e.cpu_time_total
            elif e.name in LAYER_OPS:
                parts[f"{e.name} (C++, total)"] += e.cpu_time_total
            elif e.name != "prepare_input":
                parts[f"{e.name} (total)"] += e.cpu_time_total
            else:
                parts["prepare input (total)"] += e.cpu_time_total
            continue
        if not e.name.startswith(("aten::", "mkldnn::")):
            continue
        scope = scope_of(e)
        parent = e.cpu_parent
        if parent is None or parent.name in SCOPES.values():
            top_ops += 1
        if scope == "paged_attention":
            op = e.name.replace("aten::", "")
            key = {"index_select": "gather K/V (index_select)", "index_fill_": "zero gathered tails (index_fill_)",
                   "_scaled_dot_product_flash_attention_for_cpu": "SDPA"}.get(op, "other attention ops")
            parts[f"attention: {key}"] += e.self_cpu_time_total
        elif scope == "forward" and e.name in MATMULS:
            parts["matmuls (linear layers, LM head)"] += e.self_cpu_time_total
    return {k: v / 1e3 / steps for k, v in parts.items()}, top_ops // steps


def standalone_linears(model, batch: int, repeats: int = 20) -> float:
    """ms for every linear layer of one decode step, run alone on ``[batch, in]`` inputs."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(batch, m.in_features, dtype=m.weight.dtype) for m in layers]

    def once():
        for m, x in zip(layers, xs):
            m(x)
    with torch.inference_mode():
        return 1e3 * median_thread_time(once, repeats)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[4, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--warm-steps", type=int, default=32, help="decode steps before measuring")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed, then as many profiled")
    ap.add_argument("--top", type=int, default=8, help="ops listed by self time")
    ap.add_argument("--backend", default="auto", help="attention backend: auto (the engine's default), cpu, torch")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the engine's threads option)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    hf = make_model().to(getattr(torch, a.dtype))
    pairs = length_pairs(a.batch, a.prompt_len, MODEL["max_position_embeddings"] - 128, a.batch, TRACE)
    prompts = random_prompts([p for p, _ in pairs], seed=a.batch)
    llm = LLM(hf, max_num_seqs=a.batch, attention_backend=a.backend, threads=a.threads)
    engine = llm.engine
    total = a.warm_steps + 2 * a.steps + 2
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=total, ignore_eos=True))
    while sum(m.kind == "decode" for m in engine.step_metrics) < a.warm_steps:
        engine.step(finished_only=True)
    cpu, wall = [], []  # thread CPU time misses the other threads' work with --threads 2: wall time too
    for _ in range(a.steps):
        t, w = time.thread_time(), time.perf_counter()
        engine.step(finished_only=True)
        cpu.append(time.thread_time() - t)
        wall.append(time.perf_counter() - w)
    timed = engine.step_metrics[-a.steps:]
    if any(m.kind != "decode" or m.batch_size != a.batch for m in timed):
        raise RuntimeError("the timed steps were not all full-batch decode steps")
    step_ms = 1e3 * statistics.median(cpu)
    fwd_share = sum(m.forward_time for m in timed) / sum(m.step_time for m in timed)
    instrument(engine)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            with record_function("step"):
                engine.step(finished_only=True)
    step_prof = sum(e.cpu_time_total for e in prof.events() if e.name == "step") / 1e3 / a.steps
    parts, ops = breakdown(prof, a.steps)
    machine = measure_machine()
    costs = model_costs(hf)
    ctx = timed[-1].slots_filled
    roof = decode_roofline(costs, machine, a.batch, ctx)
    alone = standalone_linears(hf, a.batch)

    print(f"{a.dtype}, {a.threads} thread(s), attention backend {engine.backend.name}; "
          f"batch {a.batch}, {ctx} context tokens, model {MODEL['num_hidden_layers']} layers x hidden "
          f"{MODEL['hidden_size']}; machine: copy {machine['copy_gb_per_s']:.1f} GB/s, matmul "
          f"{machine['matmul_gflop_per_s']:.0f} GFLOP/s ({machine['threads']} thread(s))")
    print(f"decode step (unprofiled): {step_ms:.2f} ms thread CPU time ({1e3 * statistics.median(wall):.2f} ms wall), "
          f"{100 * (1 - fwd_share):.1f} % outside the "
          f"forward; roofline {1e3 * roof['seconds']:.2f} ms ({roof['bound']}-bound: weights "
          f"{roof['weight_bytes'] / 1e6:.1f} MB, K/V {roof['kv_bytes'] / 1e6:.1f} MB, {roof['flops'] / 1e9:.2f} "
          f"GFLOP) -> {step_ms / (1e3 * roof['seconds']):.2f}x the roofline")
    print(f"profiled step: {step_prof:.2f} ms, {ops} top-level torch ops per step\n")
    print("| part | ms per step (profiled) | share of the profiled step | share x unprofiled step (ms) |")
    print("|---|---|---|---|")
    fwd = parts.get("forward (total)", 0.0)
    attn = parts.get("paged_attention (total)", 0.0)
    rows = [("attention (total)", attn)] + [(f"  {k}", v) for k, v in parts.items() if k.startswith("attention:")]
    norm, rope = parts.get("rms_norm_cpu (C++, total)", 0.0), parts.get("rope_cpu (C++, total)", 0.0)
    rows += [("KV-cache write (total)", parts.get("reshape_and_cache (total)", 0.0)),
             ("matmuls (linear layers, LM head)", parts.get("matmuls (linear layers, LM head)", 0.0)),
             ("RMSNorm with the residual add (C++, total)", norm), ("RoPE (C++, total)", rope),
             ("rest of the forward (embedding, SiLU, residuals, Python)",
              fwd - attn - parts.get("reshape_and_cache (total)", 0.0)
              - parts.get("matmuls (linear layers, LM head)", 0.0) - norm - rope),
             ("prepare input (block tables, decode plan)", parts.get("prepare input (total)", 0.0)),
             ("engine outside forward and prepare input (schedule, sample, outputs)",
              step_prof - fwd - parts.get("prepare input (total)", 0.0)),
             ("  greedy argmax (C++, total)", parts.get("argmax_cpu (C++, total)", 0.0))]
    for k, v in rows:
        print(f"| {k} | {v:.2f} | {100 * v / step_prof:.0f} % | {step_ms * v / step_prof:.2f} |")
    mm = parts.get("matmuls (linear layers, LM head)", 0.0)
    print(f"\nlinear layers run alone on the same shapes: {alone:.2f} ms (in the step: {mm:.2f} ms profiled, "
          f"{mm / alone:.2f}x)")
    top = Counter({e.key: e.self_cpu_time_total for e in prof.key_averages()})
    print("top ops by self time (ms per step): " + ", ".join(f"{k} {v / 1e3 / a.steps:.2f}"
                                                              for k, v in top.most_common(a.top)))


if __name__ == "__main__":
    main()
