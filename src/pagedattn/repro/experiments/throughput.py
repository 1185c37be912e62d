"""Experiment 03: throughput and normalized latency against contiguous baselines (paper §6.2, Figs. 12-13).

At the same KV memory, paging batches more requests, so it sustains a higher request rate before latency explodes.
Two modes share one trace per workload (seeded; the same trace, model and KV budget for every system; outputs run to
the trace's length, as with ``ignore_eos``):

- **offline**: every request arrives at t = 0; requests/s and generated tokens/s;
- **online**: Poisson arrivals at a swept rate; normalized latency (mean over requests of end-to-end latency / output
  length, in s/token), mean batched requests, KV usage over time.

A system's *sustainable rate* is the highest request rate whose normalized latency stays at or below a fixed
threshold (``NL_THRESHOLD_S``) and at which completions keep up with arrivals over the steady window (the capacity
rule), found by bisection over the rate to a 2 % resolution (``pagedattn.repro.sim.capacity``). This module's paper-scale part runs the simulated
executor at OPT-13B / A100-40GB (15.7K token slots) with the roofline step-time model of ``sim.CostModel``.

ShareGPT is the real data set (``workloads`` trace ``"sharegpt"``: OPT tokens, the first user turn and its answer,
prompt + output <= 2048); the synthetic ShareGPT-like trace is a sensitivity row for the sustainable-rate ratios. Alpaca is synthetic (no data set).
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import pandas as pd

from pagedattn.repro.sim.capacity import MAX_LENGTH_DOUBLINGS, NL_THRESHOLD_S, RESOLUTION, describe_ratio, length_agreed_search, \
    length_judged, ratio_resolution
from pagedattn.repro.paper import paper_slots
from pagedattn.repro.experiments import sensitivity
from pagedattn.repro.experiments import validated
from pagedattn.repro.sim.parallel import pmap
from pagedattn.repro.experiments.common import Arrival, Clock, ServingParams, greedy, make_engine, replay, requests_frame, \
    scaled_trace, tiny_opt_cached, torch_threads
from pagedattn.repro.paper import FIG12_RATE_RATIO, FIG13_MEAN_BATCH, HEADLINE_THROUGHPUT_GAIN
from pagedattn.repro.report.results import RESULTS_DIR, Claim, printed_interval
from pagedattn.repro.experiments.sensitivity import widened
from pagedattn.repro.sim.simulator import LABELS, CostModel, SimResult, normalized_latency, simulate
from pagedattn.repro.workloads.traces import TraceRequest, describe_trace, make_trace, synthetic_prompt, with_rate

EXPERIMENT = "03_throughput"
SIM_MODEL = "sim: OPT-13B/A100-40GB (15.7K token slots, roofline step time with A100-measured constants)"
SIM_SYSTEMS = ("ft", "orca_max", "orca_pow2", "orca_oracle", "paged")


@dataclass
@validated
class SimParams(ServingParams):
    # requests per trace: enough that an overloaded system's queue, not the trace's end, sets its latency
    num_requests: dict = field(default_factory=lambda: {"sharegpt": 1000, "alpaca": 3000})
    rates: dict = field(default_factory=lambda: {"sharegpt": [0.5, 1, 1.5, 2, 2.5, 3, 4, 5],
                                                  "alpaca": [5, 10, 20, 30, 40, 50, 60, 80]})
    rate_resolution: float = RESOLUTION  # the sustainable-rate search's resolution (``capacity``)
    #: the trace-length rule's most doublings (``capacity.length_agreed_search``); a quick run (a smoke test, whose
    #: short traces are rarely long enough to be judged) stops at one: n and 2n
    max_length_doublings: int = MAX_LENGTH_DOUBLINGS
    #: traces whose sustainable rates are found too, over the ShareGPT rate range (sensitivity rows)
    sensitivity: tuple = ("sharegpt_synthetic",)

    QUICK = dict(num_requests={"sharegpt": 100, "alpaca": 200}, rates={"sharegpt": [1, 2, 4], "alpaca": [10, 30, 60]},
                 rate_resolution=0.5, max_length_doublings=1)


def sim_run(trace, system: str, params: SimParams, cost: CostModel | None = None, record_steps: bool = True
            ) -> SimResult:
    return simulate(trace, system, paper_slots(), params.block_size, cost or CostModel(), record_steps=record_steps)


def _online_row(job: tuple, params: SimParams) -> dict:
    """One point of ``sim_online``: ``(workload, base trace, rate, system)``."""
    w, base, rate, s = job
    res = sim_run(with_rate(base, rate, params.seed), s, params)
    return {"scale": "paper (sim)", "trace": w, "rate": rate, "system": s, "label": LABELS[s],
            "normalized_latency_s": res.normalized_latency(), "mean_batch": res.mean_batch(),
            "throughput_req_s": res.throughput(), "preemptions": sum(res.num_preemptions.values())}


def sim_online(params: SimParams, progress: bool = True) -> pd.DataFrame:
    """Normalized latency and mean batch vs request rate, per workload and system (Figs. 12-13); the replays run
    in parallel (``pagedattn.repro.sim.parallel``)."""
    base = {w: make_trace(w, params.num_requests[w], 1.0, params.seed) for w in params.rates}
    jobs = [(w, base[w], r, s) for w, rates in params.rates.items() for r in rates for s in SIM_SYSTEMS]
    return pd.DataFrame(pmap(partial(_online_row, params=params), jobs, "online (sim)", progress))


@functools.lru_cache(maxsize=16)
def base_trace(w: str, n: int, seed: int):
    """The ``n``-request trace of workload ``w`` at rate 1 (``with_rate`` rescales it), made once per process."""
    return make_trace(w, n, 1.0, seed)


def _sim_requests(rate: float, n: int, w: str, system: str, params: SimParams, cost: CostModel | None
                  ) -> pd.DataFrame:
    """The per-request frame of one replay of ``w``'s ``n``-request trace at ``rate`` (a bisection's probe)."""
    return sim_run(with_rate(base_trace(w, n, params.seed), rate, params.seed), system, params, cost,
                   record_steps=False).requests


def _sim_sustainable_row(job: tuple, params: SimParams, cost: CostModel | None) -> dict:
    """One system's searches of ``sim_sustainable`` under the trace-length rule (``capacity.length_agreed_rate``,
    from the workload's ``num_requests``, with the knee measure): ``(workload, length, system, lo, hi)``."""
    w, n, s, lo, hi = job
    key = {"fn": "throughput.sim_sustainable", "trace": w, "n": n, "system": s, "lo": lo, "hi": hi,
           "threshold_s": NL_THRESHOLD_S, "params": asdict(params), "cost": asdict(cost or CostModel()), "knee": True}
    found = sensitivity.cached_search(key, lambda: length_agreed_search(
        partial(_sim_requests, w=w, system=s, params=params, cost=cost), n, lo, hi, NL_THRESHOLD_S,
        params.rate_resolution, max_doublings=params.max_length_doublings, knee=True)).row()
    return {"scale": "paper (sim)", "trace": w, "system": s, "label": LABELS[s], **found,
            "threshold_s": NL_THRESHOLD_S}


def sim_sustainable(params: SimParams, progress: bool = True, cost: CostModel | None = None,
                    traces: tuple[str, ...] | None = None, systems: tuple[str, ...] = SIM_SYSTEMS) -> pd.DataFrame:
    """Each system's sustainable rate per trace (default: every workload and the sensitivity traces); the
    bisections (one per trace and system, each sequential) run in parallel (``pagedattn.repro.sim.parallel``)."""
    ranges = {**params.rates, **{w: params.rates["sharegpt"] for w in params.sensitivity}}
    size = {**params.num_requests, **{w: params.num_requests["sharegpt"] for w in params.sensitivity}}
    traces = traces or tuple(ranges)
    jobs = [(w, size[w], s, min(ranges[w]) / 4, max(ranges[w]) * 16) for w in traces for s in systems]
    return pd.DataFrame(pmap(partial(_sim_sustainable_row, params=params, cost=cost), jobs, "sustainable rate",
                             progress))


def _offline_row(job: tuple, params: SimParams) -> dict:
    """One replay of ``sim_offline``: ``(workload, trace, system)``."""
    w, trace, s = job
    res = sim_run(trace, s, params)
    toks = res.requests["output_len"].sum()
    return {"scale": "paper (sim)", "trace": w, "system": s, "label": LABELS[s],
            "requests_per_s": len(trace) / res.duration, "tokens_per_s": toks / res.duration,
            "mean_batch": res.mean_batch()}


def sim_offline(params: SimParams, progress: bool = False) -> pd.DataFrame:
    """All requests at t = 0: requests/s and generated tokens/s of each system (replays in parallel)."""
    traces = {w: make_trace(w, params.num_requests[w], math.inf, params.seed) for w in params.rates}
    jobs = [(w, traces[w], s) for w in params.rates for s in SIM_SYSTEMS]
    return pd.DataFrame(pmap(partial(_offline_row, params=params), jobs, "offline (sim)", progress))


#: The baselines of the rate-ratio claims, which ours is divided by, and with ours the systems a band point searches
RATIO_BASELINES = ("orca_oracle", "orca_max", "ft")
RATIO_SYSTEMS = (*RATIO_BASELINES, "paged")


def rate_ratio_claims(sustainable: pd.DataFrame) -> list[Claim]:
    """Figs. 12-13's sustainable-rate ratios on the real ShareGPT trace, with the synthetic trace's beside them (in
    the note, and as ``.synthetic`` claims with the same tolerance). Judged two-sided: within the paper's range (over
    its three model sizes) widened by 25 % at each end. FasterTransformer: the paper gives "up to 22x" and, in its
    headline, at least 2x over FasterTransformer and Orca; the range 2-22x is widened the same way. Each note gives
    the ratio's resolution, the rule that bound each search and the offline-throughput ratio beside it."""
    def ratios(trace):
        s = sustainable[sustainable.trace == trace].set_index("system")["sustainable_rate"]
        return {other: float(s["paged"] / s[other]) for other in RATIO_BASELINES if other in s} \
            if len(s) else {}

    def detail(trace, other):
        rows = sustainable[sustainable.trace == trace].set_index("system")
        return describe_ratio(rows.loc["paged"], rows.loc[other])

    real, synth = ratios("sharegpt"), ratios("sharegpt_synthetic")
    out = []
    for name, other in (("paged_vs_orca_oracle", "orca_oracle"), ("paged_vs_orca_max", "orca_max"),
                        ("paged_vs_ft", "ft")):
        if other not in real:
            continue
        lo, hi = FIG12_RATE_RATIO[name]
        paper = f"{lo}-{hi}" if lo is not None else f"up to {hi}"
        a, b = widened(HEADLINE_THROUGHPUT_GAIN[0] if lo is None else lo, hi)
        tol = f"{a:.3g}-{b:.3g}" if lo is not None else "recorded: the paper gives only a maximum"
        note = (f"sim at paper scale; NL threshold {NL_THRESHOLD_S} s/token and the capacity rule; "
                f"{detail('sharegpt', other)}; {describe_trace('sharegpt')}")
        if other in synth:
            note += f"; synthetic trace: {synth[other]:.2f}"
        rows = sustainable[sustainable.trace == "sharegpt"].set_index("system")
        # FasterTransformer: the paper gives only a maximum over its settings ("up to 22x"), which one setting's
        # ratio cannot test (any ratio up to it agrees): recorded beside the range, not judged (issue 51)
        judged = lo is not None
        judge = dict(accept=[a, b], strict=[lo, hi]) if judged else \
            dict(kind="tracking", reason=f"the paper gives only a maximum over its settings ({paper}x); one "
                                         f"setting's ratio, {real[other]:.3g}, cannot test it")
        agreed = length_judged(rows.loc["paged"], rows.loc[other])
        out.append(Claim(f"rate_ratio.sharegpt.{name}", paper, round(real[other], 2), "x", tol,
                         bool(a <= real[other] <= b) if agreed and judged else None, note=note, **judge,
                         **({} if agreed or not judged else
                            {"reason": "the two trace lengths' rates did not agree (capacity.length_agreed_search)"})))
        if other in synth:
            out.append(Claim(f"rate_ratio.sharegpt.{name}.synthetic", paper, round(synth[other], 2), "x", tol,
                             bool(a <= synth[other] <= b) if judged else None,
                             note=f"sensitivity row: {describe_trace('sharegpt_synthetic')}; "
                                  f"{detail('sharegpt_synthetic', other)}; real trace: {real[other]:.2f}",
                             **judge))
    return out


def rate_ratio_table(sustainable: pd.DataFrame) -> pd.DataFrame:
    """Ours over each baseline's sustainable rate, per scale and trace, beside the paper's range (Figs. 12-13)."""
    rows = []
    for (scale, w), d in sustainable.groupby(["scale", "trace"], sort=False):
        d = d.set_index("system")
        r = d["sustainable_rate"]
        for other in RATIO_BASELINES:
            if other in r and "paged" in r:
                lo, hi = FIG12_RATE_RATIO[f"paged_vs_{other}"]
                rows.append({"scale": scale, "trace": w, "ratio": f"ours / {LABELS[other]}",
                             "ours": r["paged"] / r[other],
                             "resolution": ratio_resolution(d.loc["paged"], d.loc[other]),
                             "paper": f"{lo}-{hi}" if lo else f"up to {hi}"})
    return pd.DataFrame(rows)


def mean_batch_claims(online: pd.DataFrame) -> list[Claim]:
    out = []
    for w, paper in FIG13_MEAN_BATCH.items():
        d = online[(online.trace == w) & (online.rate == paper["rate"])].set_index("system")
        for s in ("orca_max", "orca_pow2", "orca_oracle", "paged"):
            if s in d.index:
                ours = float(d.loc[s, "mean_batch"])
                out.append(Claim(f"mean_batch.{w}.{s}", paper[s], round(ours, 2), "requests", "within 25%",
                                 bool(abs(ours / paper[s] - 1) <= 0.25),
                                 note=f"sim at {paper['rate']:g} req/s; {describe_trace(w)}",
                                 kind="invariant" if s == "orca_max" else "reproduction",  # floor(slots/2048)
                                 accept=[0.75 * paper[s], 1.25 * paper[s]], strict=printed_interval(paper[s])))
    return out


def sim_claims_at(point: sensitivity.Point, params: SimParams, which: str) -> list[Claim]:
    """The band's evaluation of 03's simulator claims under one point's assumptions: ``which`` is ``"rates"``
    (sustainable-rate ratios: a search over rates, so no rate axis) or ``"batches"`` (Fig. 13's mean batch at the
    paper's rate or at equal relative load)."""
    cost = point.cost()
    if which == "rates":
        return rate_ratio_claims(sim_sustainable(params, False, cost, ("sharegpt", *params.sensitivity),
                                                 RATIO_SYSTEMS))
    jobs = []
    for w, paper in FIG13_MEAN_BATCH.items():
        rate = sensitivity.rate_at(point, w, paper["rate"], params.num_requests[w], params.seed)
        trace = with_rate(make_trace(point.trace_name(w), params.num_requests[w], 1.0, params.seed), rate,
                          params.seed)
        jobs += [(w, paper["rate"], trace, s) for s in ("orca_max", "orca_pow2", "orca_oracle", "paged")]
    return mean_batch_claims(pd.DataFrame(pmap(partial(_mean_batch_row, params=params, cost=cost), jobs)))


def _mean_batch_row(job: tuple, params: SimParams, cost: CostModel) -> dict:
    """One replay of ``sim_claims_at``'s mean batches: ``(workload, paper's rate, trace, system)``."""
    w, rate, trace, s = job
    return {"trace": w, "rate": rate, "system": s, "mean_batch": sim_run(trace, s, params, cost).mean_batch()}


def sim_bands(params: SimParams, default: list[Claim], progress: bool = True) -> tuple[list[Claim], pd.DataFrame]:
    """03's simulator claims with their bands (``pagedattn.repro.experiments.sensitivity``) and the per-point table."""
    tables = []
    # the rate ratios are a search over rates (no rate axis, the smaller grid) and carry the synthetic trace as
    # their own .synthetic claims (no trace axis)
    for which, axes in (("rates", {"rate_axis": False, "trace_axis": False}), ("batches", {})):
        pts = sensitivity.points(params.quick, **axes)
        t = sensitivity.sweep(f"{EXPERIMENT}.{which}", partial(sim_claims_at, params=params, which=which), pts,
                              {"params": asdict(params)}, [c for c in default if c.name.startswith(
                                  "rate_ratio." if which == "rates" else "mean_batch.")], progress=progress)
        default = sensitivity.with_bands(default, t, sensitivity.describe(pts))
        tables.append(t.assign(sweep=which))
    return default, pd.concat(tables, ignore_index=True)


def sim_params_dict(params: SimParams) -> dict:
    return {"params": asdict(params), "cost_model": asdict(CostModel()), "nl_threshold_s": NL_THRESHOLD_S}


# ------------------------------------------------------------------------------------------ the real engine
#: The CPU-scale model: a small random-weight OPT (the paper's family). Only lengths matter for throughput.
TINY_OPT = dict(vocab_size=2000, hidden_size=64, num_hidden_layers=2, ffn_dim=256, num_attention_heads=4,
                max_position_embeddings=2048, init_std=0.2)


@dataclass
@validated
class RealParams(ServingParams):
    """The real engine on this machine. Lengths and the KV budget are both divided by ``scale`` so that the batching
    arithmetic of the paper's setting (15.7K slots, max length 2048, ~30 ShareGPT requests batched) is kept while a
    CPU can run the trace: ShareGPT-like lengths / 4 with 15.7K / 4 = 3.9K token slots and max length 512.

    This scale measures latency curves and offline throughput; it searches no sustainable rate. The CPU-scale
    sustainable rates are notebook 13's (``online_serving``): live servers on a budget where KV memory binds, the
    regime of the paper's Fig. 12 (§6.2). Until 2026-12-07 this notebook also searched them here, at the 3.9K budget,
    where the CPU bound every system first (each search's ``bound_by`` was latency): a second claim of the same paper
    number in a setting other than the paper's, and over half of this notebook's run time (issue 64: one paper
    number, one claim)."""

    scale: int = 4
    num_requests: int = 150
    rates: dict = field(default_factory=lambda: {"sharegpt": [4, 8, 16, 24, 32, 48, 64]})
    offline_requests: int = 150
    systems: tuple = ("ft", "orca_max", "orca_pow2", "orca_oracle", "paged")
    model: dict = field(default_factory=lambda: dict(TINY_OPT))
    threads: int = 1
    #: the engine's attention kernels (``kernels.get_backend``): ``"auto"`` is the C++ kernel on a CPU, as a user of
    #: the engine gets it (it was the torch reference until 2026-12-02, which took about a third of a step here)
    attention_backend: str = "auto"

    QUICK = dict(num_requests=24, offline_requests=24, rates={"sharegpt": [4, 16]},
                 systems=("orca_max", "orca_oracle", "paged"))

    @property
    def num_slots(self) -> int:
        return paper_slots() // self.scale

    @property
    def max_model_len(self) -> int:
        return 2048 // self.scale

    def trace(self, name: str, num_requests: int, rate: float) -> list[TraceRequest]:
        """The paper-scale trace with every length divided by ``scale`` (rounded up, at least 1 token)."""
        return scaled_trace(name, num_requests, self.scale, rate, self.seed, round_up=True)

    def engine(self, system: str, model):
        """Our engine serving as ``system`` (``common.make_engine``), every system on ``num_slots`` token slots."""
        return make_engine(model, system, self.num_slots, self.block_size, self.max_model_len, max_num_seqs=256,
                           attention_backend=self.attention_backend)


def serve(engine, trace, vocab_size: int) -> pd.DataFrame:
    """Replay a trace through the real engine (``common.replay``) on a virtual clock: the clock advances by each
    step's measured time and jumps over idle gaps, so the latencies are those of real-time serving without waiting
    for arrivals.

    Step time is this process's CPU time (``time.process_time``), not wall time: on a shared machine the wall clock
    also counts the time other processes held the cores. With one torch thread that is the work done."""
    import time

    pending = sorted(trace, key=lambda r: r.arrival_time)
    arrivals = [Arrival(r.arrival_time, r.request_id, synthetic_prompt(r.prompt_len, vocab_size, seed=i),
                        greedy(r.output_len), {"arrival_time": r.arrival_time}) for i, r in enumerate(pending)]
    served = replay(engine, arrivals, Clock(time.process_time, steps_only=True))
    df = requests_frame(trace, served).drop(columns="tokens")
    df.attrs["mean_batch"] = float(pd.Series(served.running).mean()) if served.running else float("nan")
    df.attrs["duration"] = served.duration
    return df


# Each real-engine replay below is one task of a sweep (``pagedattn.repro.sim.parallel.pmap``): it builds the model in its
# process from the seed (``common.tiny_opt_cached``) and runs with ``params.threads`` torch threads. Running them
# side by side is sound because every replay's time is its own process's CPU time (``serve``), which other
# processes on other cores do not add to (with at most one job per core; beyond cache and memory-bandwidth effects).
# What a replay computes does not depend on where it ran; its CPU timings move between runs as they always did.
def real_model(params: RealParams):
    """The CPU-scale model of ``params``: ``tiny_opt(params.seed, **params.model)``, built once per process."""
    return tiny_opt_cached(params.seed, **params.model)


def real_serve(system: str, trace, params: RealParams) -> pd.DataFrame:
    """One replay of ``trace`` on the real engine serving as ``system`` (``serve``), in this process, with
    ``params.threads`` torch threads."""
    with torch_threads(params.threads):
        return serve(params.engine(system, real_model(params)), trace, params.model["vocab_size"])


def _real_online_row(job: tuple, params: RealParams) -> dict:
    """One point of ``real_online``: ``(workload, rate, system)``."""
    w, rate, s = job
    df = real_serve(s, params.trace(w, params.num_requests, rate), params)
    return {"scale": "cpu (real engine)", "trace": w, "rate": rate, "system": s, "label": LABELS[s],
            "normalized_latency_s": normalized_latency(df), "mean_batch": df.attrs["mean_batch"],
            "throughput_req_s": len(df) / df.attrs["duration"]}


def real_online(params: RealParams, progress: bool = True) -> pd.DataFrame:
    """Normalized latency, mean batch and throughput vs request rate on this machine, per system; the replays
    (rates x systems) run in parallel (``pagedattn.repro.sim.parallel``; CPU time per replay, see above)."""
    jobs = [(w, r, s) for w, rates in params.rates.items() for r in rates for s in params.systems]
    return pd.DataFrame(pmap(partial(_real_online_row, params=params), jobs, "online (real engine)", progress))


#: ``real_offline``'s two HF baselines, run beside the systems
HF_SYSTEMS = ("hf_generate", "hf_continuous_batching")


def _real_offline_row(system: str, params: RealParams) -> dict:
    """One offline run of ``real_offline``: a system on our engine, or one of ``HF_SYSTEMS``; ``seconds`` is CPU
    time (``serve``; HF's runs time themselves the same way)."""
    from pagedattn.baselines import hf

    trace = params.trace("sharegpt", params.offline_requests, math.inf)
    if system not in HF_SYSTEMS:
        df = real_serve(system, trace, params)
        return {"system": system, "label": LABELS[system], "seconds": df.attrs["duration"],
                "mean_batch": df.attrs["mean_batch"], "note": ""}
    model = real_model(params)
    out_lens = [r.output_len for r in trace]
    prompts = [synthetic_prompt(r.prompt_len, params.model["vocab_size"], seed=i) for i, r in enumerate(trace)]
    with torch_threads(params.threads):
        if system == "hf_generate":
            static_batch = params.num_slots // params.max_model_len
            r = hf.generate_static(model, prompts, out_lens, static_batch)
            return {"system": system, "label": "HF generate()", "seconds": r["seconds"],
                    "mean_batch": float(static_batch),
                    "note": f"static batches of {static_batch} (budget / max length)"}
        try:
            r = hf.continuous_batching(model, prompts, out_lens, params.num_slots, max_requests=256,
                                       page_size=params.block_size)
            return {"system": system, "label": "HF continuous batching", "seconds": r["seconds"],
                    "mean_batch": float("nan"), "note": f"{params.num_slots} token slots, page {params.block_size}"}
        except Exception as e:  # record why it could not run, never a placeholder number
            return {"system": system, "label": "HF continuous batching", "seconds": float("nan"),
                    "mean_batch": float("nan"), "note": f"failed: {type(e).__name__}: {e}"}


def real_offline(params: RealParams, progress: bool = True) -> pd.DataFrame:
    """All requests at t = 0 through every system on this machine, plus HF ``generate()`` in static batches as
    large as the budget allows at the maximum length, and HF's continuous batching on the same token slots; the
    runs go in parallel (``pagedattn.repro.sim.parallel``; CPU time per run, see above)."""
    trace = params.trace("sharegpt", params.offline_requests, math.inf)
    # HF generate() first: the longest run
    jobs = ["hf_generate", *params.systems, "hf_continuous_batching"]
    df = pd.DataFrame(pmap(partial(_real_offline_row, params=params), jobs, "offline (real engine)", progress))
    df = df.set_index("system").loc[[*params.systems, *HF_SYSTEMS]].reset_index()  # the table's order as before
    df["requests_per_s"] = len(trace) / df["seconds"]  # CPU seconds (see serve)
    df["tokens_per_s"] = sum(r.output_len for r in trace) / df["seconds"]
    return df


def real_threshold(online: pd.DataFrame) -> float:
    """The CPU scale's latency threshold: 5x the paged engine's normalized latency at the lowest swept rate (the
    paper scale's 0.2 s/token is about 5x its unloaded latency, too)."""
    d = online[online.system == "paged"].sort_values("rate")
    return 5 * float(d["normalized_latency_s"].iloc[0])


def system_configs(params: RealParams) -> pd.DataFrame:
    """What every system gets: the same model, trace and token budget; only the KV manager and batching differ."""
    rows = []
    for s in params.systems:
        mgr = {"paged": f"BlockManager(block_size={params.block_size}, {params.num_slots // params.block_size} blocks)",
               "ft": f"ContiguousKVManager('max'), static batching"}.get(
            s, f"ContiguousKVManager('{s.removeprefix('orca_')}', buddy)")
        rows.append({"system": s, "label": LABELS[s], "kv_budget_slots": params.num_slots, "kv_manager": mgr,
                     "max_model_len": params.max_model_len, "model": "OPT " + str(params.model)})
    rows.append({"system": "hf_generate", "label": "HF generate()", "kv_budget_slots": params.num_slots,
                 "kv_manager": f"contiguous cache, static batches of {params.num_slots // params.max_model_len}",
                 "max_model_len": params.max_model_len, "model": "same weights"})
    rows.append({"system": "hf_continuous_batching", "label": "HF continuous batching",
                 "kv_budget_slots": params.num_slots, "kv_manager": f"HF paged cache, page {params.block_size}",
                 "max_model_len": params.max_model_len, "model": "same weights"})
    return pd.DataFrame(rows)


def real_claims(offline: pd.DataFrame) -> list[Claim]:
    """The CPU real engine's offline ratios against Hugging Face: CPU timings of a tiny model, recorded
    (``kind="tracking"``), not judged against the paper's GPU-scale numbers."""
    o = offline.set_index("system")["tokens_per_s"]
    out = []
    for other in ("hf_generate", "hf_continuous_batching"):
        ratio = float(o["paged"] / o[other]) if other in o and math.isfinite(o[other]) else None
        note = "CPU timing, tiny random-weight OPT, offline, same KV budget"
        if ratio is None:
            note += "; " + str(offline.set_index("system").loc[other, "note"]) if other in o else "; not run"
        out.append(Claim(f"throughput_ratio.paged_vs_{other}", "2-4x (vs FasterTransformer/Orca)",
                         None if ratio is None else round(ratio, 2), "x", "", None, note, kind="tracking"))
    return out


def run(quick: bool = False, results_dir: str | Path = RESULTS_DIR, progress: bool = True, real: bool = True,
        **kw) -> dict:
    """Both scales; writes CSVs and ``summary.json`` to ``<results_dir>/03_throughput/``; returns the tables."""
    from pagedattn.kernels import get_backend
    from pagedattn.repro.report.results import hardware_label, write_summary

    sp = SimParams.make(quick)
    rp = RealParams.make(quick, **kw)
    out_dir = Path(results_dir) / EXPERIMENT
    out_dir.mkdir(parents=True, exist_ok=True)
    tables: dict = {}
    if real:
        tables["real_configs"] = system_configs(rp)
        tables["real_online"] = real_online(rp, progress)
        tables["real_offline"] = real_offline(rp, progress)
    tables |= {"sim_online": sim_online(sp, progress), "sim_sustainable": sim_sustainable(sp, progress),
               "sim_offline": sim_offline(sp)}
    claims, tables["sensitivity"] = sim_bands(sp, rate_ratio_claims(tables["sim_sustainable"])
                                              + mean_batch_claims(tables["sim_online"]), progress)
    if real:
        claims += real_claims(tables["real_offline"])
    tables["rate_ratios"] = rate_ratio_table(tables["sim_sustainable"])
    for name, df in tables.items():
        df.to_csv(out_dir / f"{name}.csv", index=False)
    hw = hardware_label("cpu")
    m = rp.model
    model_label = (f"{SIM_MODEL}; real engine: OPT (random weights, fp32; hidden {m['hidden_size']}, "
                   f"{m['num_hidden_layers']} layers, vocab {m['vocab_size']}; {get_backend(rp.attention_backend).name} "
                   f"attention kernel), lengths and budget / {rp.scale}")
    write_summary(out_dir, EXPERIMENT, f"{hw} (real engine); sim for paper scale", model_label, quick, claims,
                  extra={"sim": sim_params_dict(sp), "real": asdict(rp) | {"num_slots": rp.num_slots}})
    tables["label"] = f"{hw} | {model_label} | quick={quick}"
    tables["out_dir"] = out_dir
    tables["claims"] = claims
    return tables
