"""Experiment 05: the choice of block size (paper §7.2, Fig. 18b).

The block size trades two costs (§7.2): small blocks make the attention kernel read K/V in small pieces (more
block-table lookups, less work per block, less parallelism per block on a GPU); large blocks waste memory inside each
request's last block (internal fragmentation: fewer requests fit, so fewer are batched, §4.2) and make the kernel
read that empty tail too. The paper finds block sizes 16-128 best on ShareGPT, 16-32 on Alpaca (larger blocks degrade
there: its sequences are shorter than a block), and picks 16 as the default.

Two scales, both sweeping block sizes 1-256 at a fixed Poisson request rate per trace:

- **paper scale, simulated** (``sim.py``: the real scheduler and block manager, OPT-13B / A100-40GB, 15.7K token
  slots) on real ShareGPT (OPT tokens, the default pairing of ``workloads``; the synthetic ShareGPT-like trace as a sensitivity row) and the
  synthetic Alpaca trace (no data set installs). ShareGPT's rate follows a rule fixed in advance: ``KNEE_FRACTION``
  of the paged system's sustainable rate at block 16 (``capacity.length_agreed_search``), i.e. just below its knee;
  Alpaca keeps 50 req/s (``RATES``).
  The roofline's KV-read term gets a per-block-size multiplier ``kernel_overhead(bs) = g(bs) x p(bs) / p(16)``:
  ``g(bs) = (1 + beta / bs) / (1 + beta / 16)``, a fixed cost of ``beta`` token-equivalents per block; ``p`` is
  *computed from the trace*: tokens the kernel reads (whole blocks, including the last block's empty tail) over
  context tokens, over every decode step of every request. Block 16 keeps multiplier 1, the cost model's default.
  ``beta`` is *measured*: the torch reference paged attention is timed at every block size (decode batches whose
  contexts are multiples of 256, so no block is partly filled) and its time fitted as ``a x (1 + beta / bs)``. A CPU
  fit moves between machines and runs (0.18-0.75 in the eight committed runs), and the judged block sizes moved with
  it, so the judged claims use a committed value (``PER_BLOCK_COST_TOKENS``, the median of those fits: "committed
  kernel"); this run's own fit is a tracking claim, with the block sizes it picks ("measured kernel") in its note.
- **CPU, real engine**: a tiny random-weight OPT (``transformers.OPTConfig``, ``init_std=0.2``) served by our
  ``LLMEngine`` with the torch kernels, on a small trace with the paper's traces' lengths divided by 4 and a KV pool
  of 1024 token slots at every block size (small enough that memory binds), at a rate of 0.85 x the engine's
  measured offline throughput at block 16 (near its knee). Time is the engine's CPU time (one thread), not wall
  time: on a shared machine other processes stretch wall time by 2-4x, erratically.

Claims: ``best_block_sizes.{sharegpt,alpaca}``: block sizes whose normalized latency (paper scale, committed kernel
multiplier) is within 10 % of the best, next to the paper's ranges; ``per_block_cost_tokens.cpu`` (tracking): this
run's fitted ``beta``.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from pagedattn.repro.progress import interactive

from pagedattn.repro.experiments import sensitivity
from pagedattn.repro.paper import paper_slots
from pagedattn.repro.experiments import validated
from pagedattn.repro.experiments.kv_waste import kv_waste_pct
from pagedattn.repro.experiments.common import (TINY_OPT_SHAPE, Arrival, Clock, ExperimentParams, fastest, greedy, replay,
                                          requests_frame, scaled_trace, tiny_opt)
from pagedattn.repro.sim.capacity import MAX_LENGTH_DOUBLINGS
from pagedattn.repro.sim.parallel import pmap
from pagedattn.repro.paper import DEFAULT_BLOCK_SIZE, FIG18B_BEST_BLOCK_SIZES
from pagedattn.repro.report.results import RESULTS_DIR, Claim, hardware_label, write_summary
from pagedattn.repro.sim.simulator import CostModel, simulate
from pagedattn.repro.workloads.traces import TraceRequest, describe_trace, make_trace, with_rate

EXPERIMENT = "05_block_size"
SIM_MODEL = "sim: OPT-13B/A100-40GB (15.7K token slots, roofline step time with A100-measured constants x a kernel multiplier per block size)"
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TRACES = ("sharegpt", "alpaca")
#: Poisson request rates (req/s) of the paper-scale sweep, near the paged system's knee at block 16 so that memory
#: holds the batch back. ShareGPT: 1.8 req/s, just below the paper's Fig. 13 rate of 2, at which our simulated
#: system is past its knee (queues grow through the run, latency doubles, and any capacity difference is amplified).
#: Alpaca: 50 req/s, above the paper's 30, at which our roofline (faster than the 2023 system at large batches) is
#: not yet memory-bound, so the block size would not matter.
RATES = {"sharegpt": 1.8, "alpaca": 50.0}
#: ShareGPT traces (real and synthetic) run at this fraction of the paged system's sustainable rate at block 16, a
#: rule fixed before the real trace was swept (the real trace's outputs are shorter, so 1.8 req/s leaves it idle).
KNEE_FRACTION = 0.8
#: the synthetic ShareGPT-like trace, swept at paper scale as a sensitivity row
SENSITIVITY = "sharegpt_synthetic"
#: a block size is among the best when its normalized latency is within this factor of the best one's
BEST_WITHIN = 1.10
#: The kernel's per-block cost in token-equivalents (``fit_per_block_cost``) that the judged claims use: the median of
#: the eight CPU fits committed before it was fixed (0.18, 0.44, 0.51, 0.57, 0.57, 0.61, 0.62, 0.75: commits 497e489
#: to 8c492fe, 2026-12-01/02, two AMD EPYC VMs). Fixed for reproducibility (issue 26: the judged block sizes moved
#: with each run's fit), not for a verdict: the ShareGPT claims failed at every one of those fits.
PER_BLOCK_COST_TOKENS = 0.57
#: the paper-scale sweep's kernel multipliers: the committed per-block cost (judged), this CPU's fit, and none at all
#: (``kernel_overhead = 1``: memory effects only)
VARIANTS = ("committed kernel", "measured kernel", "memory only")


@dataclass
@validated
class Params(ExperimentParams):
    block_sizes: tuple[int, ...] = BLOCK_SIZES
    # paper scale (simulated)
    num_requests: int = 1000
    rates: dict = field(default_factory=lambda: {"alpaca": RATES["alpaca"]})  # ShareGPT: set by the knee rule
    knee_resolution: float = 0.02  # the knee's sustainable-rate search (``capacity``)
    #: the trace-length rule's most doublings (``capacity.length_agreed_search``); a quick run (a smoke test, whose
    #: short traces are rarely long enough to be judged) stops at one: n and 2n
    max_length_doublings: int = MAX_LENGTH_DOUBLINGS
    # kernel measurement (torch reference on the CPU)
    kernel_batch: int = 8
    kernel_contexts: tuple[int, ...] = (256, 1024)
    kernel_rounds: int = 5
    # CPU real engine
    engine_block_sizes: tuple[int, ...] = BLOCK_SIZES
    engine_requests: int = 48
    engine_length_scale: int = 4  # trace lengths divided by this
    engine_slots: int = 1024  # small enough that memory binds (~8 scaled ShareGPT requests)
    engine_load: float = 0.85  # Poisson rate = this x offline throughput at block 16

    # a quick run is a smoke test of every path (issue 64), not a measurement: a shorter trace for the knee search
    # and the sweep, and fewer CPU-engine requests (still two engine block sizes, four simulated)
    QUICK = dict(num_requests=100, knee_resolution=0.25, block_sizes=(1, 16, 64, 256), kernel_contexts=(256,),
                 kernel_rounds=2, engine_block_sizes=(16, 256), engine_requests=4, max_length_doublings=1)


# ------------------------------------------------------------------------------------------- kernel multiplier
def measure_kernel(block_sizes=BLOCK_SIZES, batch: int = 8, contexts=(256, 1024), rounds: int = 3,
                   num_heads: int = 8, head_dim: int = 64, seed: int = 0, reps: int = 6) -> pd.DataFrame:
    """Decode attention latency of the torch reference paged kernel (``kernels.get_backend("torch")``) per block
    size, on a shuffled block table, one thread, fp32, in CPU time (``common.fastest``). Every block size is timed
    round-robin, in a new random order each rep, and keeps its fastest run of the round; ``ratio_to_block16`` is the
    median over ``rounds`` rounds of that round's time / block 16's (``ratio_min``/``ratio_max``: the spread, i.e. the noise of a
    shared machine). Contexts are multiples of 256, so no block is partly filled: this isolates ``g(bs)``."""
    from pagedattn import kernels
    from pagedattn.repro.experiments.attention_kernel import make_paged_inputs

    ops = kernels.get_backend("torch")
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for ctx in contexts:
            fns = {}
            for bs in block_sizes:
                q, kc, vc, table, lens = make_paged_inputs([ctx] * batch, num_heads, num_heads, head_dim, bs,
                                                           torch.float32, "cpu", seed, share=False)
                fns[bs] = (lambda q=q, kc=kc, vc=vc, t=table, n=lens:
                           ops.paged_attention(q, kc, vc, t, n, head_dim ** -0.5))
            per_round = [{bs: 1e3 * t for bs, t in fastest(fns, reps, order_seed=seed + r)[0].items()}
                         for r in range(rounds)]
            for bs in block_sizes:
                ratios = [t[bs] / t[DEFAULT_BLOCK_SIZE] for t in per_round]
                ms = min(t[bs] for t in per_round)
                rows.append({"batch": batch, "context": ctx, "block_size": bs, "ms": ms,
                             "ms_per_1k_tokens": ms / (batch * ctx / 1000),
                             "ratio_to_block16": float(np.median(ratios)), "ratio_min": min(ratios),
                             "ratio_max": max(ratios), "rounds": rounds})
    finally:
        torch.set_num_threads(prev)
    return pd.DataFrame(rows)


def padding_factor(trace: list[TraceRequest], block_size: int) -> float:
    """Tokens the kernel reads (whole blocks: ``ceil(L / bs) x bs``) over context tokens ``L``, summed over every
    decode step of every request of the trace (contexts ``prompt + 1 .. prompt + output``)."""
    read = ctx = 0.0
    for r in trace:
        lens = np.arange(r.prompt_len + 1, r.prompt_len + r.output_len + 1)
        read += float((-(-lens // block_size) * block_size).sum())
        ctx += float(lens.sum())
    return read / ctx


def fit_per_block_cost(kernel: pd.DataFrame) -> float:
    """Fit the kernel's time per context as ``a x (1 + beta / bs)``: ``a`` the cost of reading the tokens, ``beta``
    the fixed cost of one block (its table lookup and set-up) in token-equivalents. Least squares of the fastest
    time on ``1 / bs`` per context; ``beta`` is the mean of the contexts' ``slope / intercept``, at least 0 (a
    negative fit means no measurable per-block cost). Fitting one parameter to all block sizes averages out the
    noise that single ratios carry on a shared machine."""
    betas = []
    for _, d in kernel.groupby("context"):
        slope, intercept = np.polyfit(1.0 / d.block_size.to_numpy(float), d.ms.to_numpy(float), 1)
        betas.append(slope / intercept)
    return max(0.0, float(np.mean(betas)))


def g_model(block_size, beta: float):
    """The fitted per-block cost relative to block 16: ``(1 + beta / bs) / (1 + beta / 16)``."""
    return (1 + beta / np.asarray(block_size, float)) / (1 + beta / DEFAULT_BLOCK_SIZE)


def kernel_multipliers(kernel: pd.DataFrame, traces: dict[str, list[TraceRequest]]) -> pd.DataFrame:
    """``kernel_overhead(bs) = g(bs) x p(bs) / p(16)`` per trace and block size: ``g`` at this run's fitted per-block
    cost (:func:`fit_per_block_cost`: ``g_fit``, ``kernel_overhead``; the raw median ratios are kept as
    ``g_measured``) and at ``PER_BLOCK_COST_TOKENS`` (``g_committed``, ``kernel_overhead_committed``), ``p`` the
    trace's padding factor."""
    g_raw = kernel.groupby("block_size")["ratio_to_block16"].mean()
    beta = fit_per_block_cost(kernel)
    rows = []
    for w, trace in traces.items():
        p16 = padding_factor(trace, DEFAULT_BLOCK_SIZE)
        for bs, gv in g_raw.items():
            p = padding_factor(trace, int(bs))
            g, gc = float(g_model(bs, beta)), float(g_model(bs, PER_BLOCK_COST_TOKENS))
            rows.append({"trace": w, "block_size": int(bs), "g_measured": float(gv), "beta_tokens": beta,
                         "g_fit": g, "g_committed": gc, "padding_factor": p, "kernel_overhead": g * p / p16,
                         "kernel_overhead_committed": gc * p / p16})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------------ paper scale
def sim_sweep(traces: dict[str, list[TraceRequest]], multipliers: pd.DataFrame, block_sizes=BLOCK_SIZES,
              progress: bool = True, variants=VARIANTS, base: CostModel | None = None) -> pd.DataFrame:
    """Normalized latency, mean batch and KV waste per block size at paper scale, under each of ``VARIANTS``' kernel
    multipliers (``multipliers``: :func:`kernel_multipliers`); step-time constants from ``base`` (default
    ``CostModel()``)."""
    jobs = [(w, bs, k) for w in traces for bs in block_sizes for k in variants]
    mult = multipliers.set_index(["trace", "block_size"])
    column = {"committed kernel": "kernel_overhead_committed", "measured kernel": "kernel_overhead"}
    tasks = [(traces[w], w, bs, kind, replace(base or CostModel(), kernel_overhead=float(
        mult.loc[(w, bs), column[kind]]) if kind in column else 1.0)) for w, bs, kind in jobs]
    return pd.DataFrame(pmap(_sweep_row, tasks, "block-size sweep (sim)", progress))


def _sweep_row(task: tuple) -> dict:
    """One replay of :func:`sim_sweep`: ``(trace, trace name, block size, variant, cost model)``."""
    trace, w, bs, kind, cost = task
    r = simulate(trace, "paged", paper_slots(), bs, cost, record_steps=True)
    steps = r.steps
    dec = steps[steps.kind == "decode"]
    waste = kv_waste_pct(r)
    return {"scale": "paper (sim)", "trace": w, "block_size": bs, "variant": kind,
            "kernel_overhead": cost.kernel_overhead, "normalized_latency_s": r.normalized_latency(),
            "mean_batch": r.mean_batch(), "kv_waste_pct": waste,
            "max_request_waste_slots": int(steps["max_request_waste"].max()),
            "preemptions": sum(r.num_preemptions.values()), "decode_steps": len(dec)}


def best_block_sizes(df: pd.DataFrame, within: float = BEST_WITHIN) -> dict[str, list[int]]:
    """Per trace, the block sizes within ``within`` x the best normalized latency."""
    out = {}
    for w, d in df.groupby("trace", sort=False):
        best = d.normalized_latency_s.min()
        out[w] = sorted(int(b) for b in d[d.normalized_latency_s <= within * best].block_size)
    return out


def clearly_worse(df: pd.DataFrame, factor: float = 2.0) -> dict[str, list[int]]:
    """Per trace, the block sizes whose normalized latency is above ``factor`` x the best (robust to the noise of
    single CPU runs, unlike a 10 % band)."""
    return {w: sorted(int(b) for b in d[d.normalized_latency_s > factor * d.normalized_latency_s.min()].block_size)
            for w, d in df.groupby("trace", sort=False)}


# ---------------------------------------------------------------------------------------------- CPU, real engine
#: The CPU engine's model (``common.tiny_opt``): the common small OPT with an FFN of 2 x hidden.
ENGINE_SHAPE = dict(ffn_dim=2 * TINY_OPT_SHAPE["hidden_size"])


def model_label(hf) -> str:
    c = hf.config
    return (f"random-weight OPT: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads, "
            f"vocab {c.vocab_size}, fp32, torch kernels")


def engine_run(hf, trace: list[TraceRequest], block_size: int, slots: int, seed: int = 0, **engine_kw):
    """Serve a trace on a fresh engine with a pool of ``slots // block_size`` blocks (``common.replay``): each
    request is added once its arrival time has passed, with random prompt tokens, greedy decoding and
    ``max_tokens`` = its output length (``ignore_eos``). Time is the engine's CPU time (``common.Clock``: this
    thread's, one torch thread, idle gaps skipped), so a request's latency is the CPU time the engine spent from its
    arrival to its last token. Returns one row per request (latency, normalized latency per generated token,
    tokens) and the engine."""
    from pagedattn.engine import LLMEngine

    engine_kw.setdefault("max_step_metrics", None)  # engine_summary reads every step
    engine = LLMEngine(hf, block_size=block_size, num_gpu_blocks=max(1, slots // block_size),
                       attention_backend="torch", **engine_kw)
    rng = np.random.default_rng(seed)
    arrivals = [Arrival(r.arrival_time, r.request_id, rng.integers(3, engine.vocab_size, r.prompt_len).tolist(),
                        greedy(r.output_len)) for r in sorted(trace, key=lambda r: r.arrival_time)]
    reqs = requests_frame(trace, replay(engine, arrivals, Clock()))
    reqs["latency_s"] = reqs.finish_time - reqs.arrival_time
    reqs["normalized_latency_s"] = reqs.latency_s / reqs.tokens.map(len).clip(lower=1)
    return reqs, engine


def engine_summary(reqs: pd.DataFrame, engine, wall_s: float) -> dict:
    m = engine.step_metrics_frame()
    dec = m[m.kind == "decode"]
    bs = engine.kv.block_size
    waste = 100 * (1 - dec.slots_filled.sum() / (dec.blocks_used * bs).sum()) if len(dec) else float("nan")
    return {"normalized_latency_s": float(reqs.normalized_latency_s.mean()), "wall_s": wall_s, "mean_batch": float(dec.batch_size.mean()),
            "kv_waste_pct": waste, "preemptions": sum(engine.scheduler.num_preemptions.values()),
            "mean_step_ms_wall": 1e3 * float(m.step_time.mean()),
            "mean_forward_ms_wall": 1e3 * float(m.forward_time.mean()),
            "errors": int(reqs.error.notna().sum())}


def engine_sweep(params: Params, progress: bool = True) -> tuple[pd.DataFrame, str]:
    """CPU, real engine: per trace, calibrate the rate (offline throughput at block 16 x ``engine_load``), then
    replay the Poisson trace at that rate for every block size; in the engine's CPU time (``common.Clock``)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # steadier on a shared machine; the tiny model gains nothing from a second thread
    try:
        return _engine_sweep(params, progress)
    finally:
        torch.set_num_threads(prev)


def _engine_sweep(params: Params, progress: bool) -> tuple[pd.DataFrame, str]:
    hf = tiny_opt(params.seed, **ENGINE_SHAPE)
    rows = []
    jobs = [(w, bs) for w in TRACES for bs in params.engine_block_sizes]
    rates = {}
    for w, bs in tqdm(jobs, desc="block-size sweep (CPU engine)", disable=not (progress and interactive()), leave=False):
        if w not in rates:
            offline = scaled_trace(w, params.engine_requests, params.engine_length_scale, seed=params.seed)
            clock = Clock()
            engine_run(hf, offline, DEFAULT_BLOCK_SIZE, params.engine_slots, params.seed)
            rates[w] = params.engine_load * len(offline) / clock()
        trace = scaled_trace(w, params.engine_requests, params.engine_length_scale, rates[w], params.seed)
        t, clock = time.perf_counter(), Clock()
        reqs, engine = engine_run(hf, trace, bs, params.engine_slots, params.seed)
        rows.append({"scale": "CPU engine", "trace": w, "block_size": bs, "rate": rates[w], "cpu_s": clock(),
                     **engine_summary(reqs, engine, time.perf_counter() - t)})
    return pd.DataFrame(rows), model_label(hf)


def knee_rate(name: str, params: Params) -> float:
    """``KNEE_FRACTION`` x the paged system's sustainable rate at block 16 on the trace ``name`` of
    ``params.num_requests`` requests (the rule for ShareGPT), under the one trace-length rule of every search
    (``capacity.length_agreed_search``, issue 50: the trace doubles while the rates on n and 2n requests disagree).
    A rate the rule leaves unagreed is still used (it only sets the sweep's load) and its reason is printed."""
    from pagedattn.repro.sim.capacity import NL_THRESHOLD_S, length_agreed_search

    def requests(rate, length):
        return simulate(with_rate(make_trace(name, length, 1.0, params.seed), rate, params.seed), "paged",
                        paper_slots(), DEFAULT_BLOCK_SIZE, CostModel(), record_steps=False).requests
    key = {"fn": "block_size.knee_rate", "trace": name, "n": params.num_requests, "seed": params.seed,
           "resolution": params.knee_resolution, "slots": paper_slots(), "block_size": DEFAULT_BLOCK_SIZE,
           "cost": asdict(CostModel()), "threshold_s": NL_THRESHOLD_S, "max_doublings": params.max_length_doublings}
    found = sensitivity.cached_search(key, lambda: length_agreed_search(
        requests, params.num_requests, 0.25, 16.0, NL_THRESHOLD_S, params.knee_resolution,
        max_doublings=params.max_length_doublings, offline=False))
    if not found.length_agreed:
        print(f"{name}: {found.length_reason}")
    return KNEE_FRACTION * found.rate


def knee_rates(names: list[str], params: Params, progress: bool = False) -> dict[str, float]:
    """:func:`knee_rate` of each trace, the bisections in parallel (``pagedattn.repro.sim.parallel``)."""
    return dict(zip(names, pmap(partial(knee_rate, params=params), list(names), "knee rates", progress)))


# ------------------------------------------------------------------------------------------------ claims, run
def claims(best: dict[str, list[int]], best_memory_only: dict[str, list[int]], best_measured: dict[str, list[int]],
           beta: float | None, engine_best: dict[str, list[int]], rates: dict | None = None,
           engine_worse: dict[str, list[int]] | None = None) -> list[Claim]:
    """Fig. 18b's claims: ``best`` under the committed kernel multiplier (judged), ``best_memory_only`` and
    ``best_measured`` (this CPU's fitted per-block cost ``beta``; ``None``: not measured here) in the notes."""
    rates = rates or RATES
    b = PER_BLOCK_COST_TOKENS
    out = []
    for w in (*TRACES, SENSITIVITY):
        if w not in best:
            continue
        paper, ours = FIG18B_BEST_BLOCK_SIZES["sharegpt" if w == SENSITIVITY else w], best.get(w, [])
        # the paper's best range does well here, and no block outside it does: neither a larger one (internal
        # fragmentation, empty tails read) nor a smaller one (the kernel's per-block cost)
        holds = set(paper) <= set(ours) and max(ours, default=0) <= max(paper) and min(ours, default=0) >= min(paper)
        extra = sorted(set(ours) - set(paper))
        missing = sorted(set(paper) - set(ours))
        note = (f"{describe_trace(w)}; sim at paper scale, {rates[w]:.3g} req/s"
                f"{f' ({KNEE_FRACTION:g} x the sustainable rate at block 16)' if w != 'alpaca' else ''}, "
                f"within {BEST_WITHIN - 1:.0%} of the best "
                f"normalized latency, kernel multiplier at the committed per-block cost of {b:g} token-equivalents "
                f"(g(1)={float(g_model(1, b)):.2f}, g(256)={float(g_model(256, b)):.2f} x block 16). ")
        if extra and min(extra) < min(paper):
            note += (f"Small blocks {[b for b in extra if b < min(paper)]} also do well: the CPU torch gather pays "
                     "little per block, unlike the paper's GPU kernel (less parallelism per block). ")
        if missing:
            note += (f"Paper's {missing} fall outside: at this near-knee rate their internal fragmentation (more "
                     "preemptions) and the empty tails the kernel reads cost more than 10 %. ")
        note += f"Memory effects alone: {best_memory_only.get(w)}. "
        if beta is not None:
            note += f"At this CPU's fitted per-block cost ({beta:.2f}): {best_measured.get(w)}. "
        if w == SENSITIVITY:
            note += f"Real trace: {best.get('sharegpt')}."
        else:
            note += (f"CPU engine (CPU time, one run each, noisy on a shared machine): within 10%: "
                     f"{engine_best.get(w)}; more than 2x the best: {(engine_worse or {}).get(w)}.")
            if w == "sharegpt" and SENSITIVITY in best:
                note += f" Synthetic trace: {best[SENSITIVITY]}."
        name = "best_block_sizes.sharegpt.synthetic" if w == SENSITIVITY else f"best_block_sizes.{w}"
        small, large = [x for x in extra if x < min(paper)], [x for x in extra if x > max(paper)]
        why = []
        if small:
            why.append(f"{small} also within {BEST_WITHIN - 1:.0%}: the committed per-block cost ({b:g}, CPU fits) "
                       "barely penalizes small blocks")
        if large:
            why.append(f"{large} also within {BEST_WITHIN - 1:.0%}")
        if missing:
            why.append(f"paper's {missing} lose > {BEST_WITHIN - 1:.0%} (fragmentation, empty tails)")
        reason = "; ".join(why) if not holds else ""
        out.append(Claim(name, paper, ours, "tokens",
                         "contains the paper's range; no larger or smaller block as good", holds, note,
                         at_measured=holds, reason=reason))
    if beta is not None:
        out.append(Claim("per_block_cost_tokens.cpu", None, beta, "token-equivalents", "", None,
                         f"the torch reference kernel's fixed cost per block on this CPU (fp32, one thread), fitted "
                         f"as a x (1 + beta / block size); the judged claims use {b:g} (PER_BLOCK_COST_TOKENS)",
                         kind="tracking"))
    return out


def claims_at(point: sensitivity.Point, params: Params, kernel: pd.DataFrame, rates: dict) -> list[Claim]:
    """Fig. 18b's claims under one point's assumptions (step time, and each trace's rate itself or at equal load),
    with the committed kernel multiplier: the band's evaluation (``kernel`` only lists the block sizes). The CPU
    engine is not rerun (its sets stay in the default run's note)."""
    traces = {w: with_rate(make_trace(w, params.num_requests, 1.0, params.seed),
                           sensitivity.rate_at(point, w, rates[w], params.num_requests, params.seed), params.seed)
              for w in rates}
    sim = sim_sweep(traces, kernel_multipliers(kernel, traces), params.block_sizes, False, ("committed kernel",),
                    point.cost())
    return claims(best_block_sizes(sim), {}, {}, None, {}, rates)


def run(quick: bool = False, results_dir: str | Path = RESULTS_DIR, progress: bool = True, **kw) -> dict:
    """Run the whole experiment; write CSVs and ``summary.json`` under ``<results_dir>/05_block_size/``."""
    params = Params.make(quick, **kw)
    out_dir = Path(results_dir) / EXPERIMENT
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    base = {w: make_trace(w, params.num_requests, 1.0, params.seed) for w in (*TRACES, SENSITIVITY)}
    knees = knee_rates([w for w in base if w not in params.rates], params, progress)
    rates = {w: params.rates[w] if w in params.rates else knees[w] for w in base}
    traces = {w: with_rate(base[w], rates[w], params.seed) for w in base}
    kernel = measure_kernel(params.block_sizes, params.kernel_batch, params.kernel_contexts, params.kernel_rounds,
                            seed=params.seed)
    mult = kernel_multipliers(kernel, traces)
    sim = sim_sweep(traces, mult, params.block_sizes, progress)
    engine, engine_model = engine_sweep(params, progress)
    best = best_block_sizes(sim[sim.variant == "committed kernel"])
    best_measured = best_block_sizes(sim[sim.variant == "measured kernel"])
    best_mem = best_block_sizes(sim[sim.variant == "memory only"])
    engine_best = best_block_sizes(engine)
    engine_worse = clearly_worse(engine)
    sources = (("paper (Fig. 18b)", FIG18B_BEST_BLOCK_SIZES), ("ours: sim, committed kernel", best),
               ("ours: sim, this CPU's kernel", best_measured), ("ours: sim, memory only", best_mem),
               ("ours: CPU engine", engine_best))
    best_table = pd.DataFrame([{"trace": w, "source": src, "best_block_sizes": " ".join(map(str, b[w]))}
                               for src, b in sources for w in (*TRACES, SENSITIVITY) if w in b])
    tables = {"kernel_latency": kernel, "kernel_multiplier": mult, "sim_sweep": sim, "engine_sweep": engine,
              "best_block_sizes": best_table}
    for name, df in tables.items():
        df.to_csv(out_dir / f"{name}.csv", index=False)
    hw = hardware_label("cpu")
    model = f"{SIM_MODEL}; CPU engine: {engine_model}"
    default = claims(best, best_mem, best_measured, float(mult.beta_tokens.iloc[0]), engine_best, rates, engine_worse)
    # the synthetic ShareGPT trace is its own .synthetic claim (no trace axis)
    pts = sensitivity.points(quick, trace_axis=False, rate_scales=() if quick else (1 / 1.2, 1.2))
    band = sensitivity.sweep(EXPERIMENT, partial(claims_at, params=params, kernel=kernel, rates=rates), pts,
                             {"params": asdict(params), "rates": rates, "per_block_cost": PER_BLOCK_COST_TOKENS},
                             default, progress=progress)
    band.to_csv(out_dir / "sensitivity.csv", index=False)
    tables["sensitivity"] = band
    write_summary(out_dir, EXPERIMENT, f"{hw} (kernel timing, CPU engine) + {hardware_label('sim')}", model, quick,
                  sensitivity.with_bands(default, band, sensitivity.describe(pts)),
                  extra={"params": asdict(params), "cost_model": asdict(CostModel()), "best_within": BEST_WITHIN,
                         "rates_req_s": {"sim": rates, "knee_fraction": KNEE_FRACTION,
                                         "cpu_engine": engine.groupby("trace").rate.first().to_dict()},
                         "gpu": "not run: no GPU was lent to this task; the kernel multiplier is measured on the CPU",
                         "runtime_s": time.perf_counter() - t0})
    tables.update(best=best, best_measured=best_measured, best_memory_only=best_mem, engine_best=engine_best, engine_worse=engine_worse,
                  params=params, rates=rates,
                  label=f"{hw} | {SIM_MODEL} | CPU engine: {engine_model} | quick={quick}", out_dir=out_dir,
                  runtime_s=time.perf_counter() - t0)
    return tables
