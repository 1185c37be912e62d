"""Experiment 07: a shared prefix (paper §4.4 "Shared prefix", §6.4 Fig. 16) and automatic prefix caching.

The paper's workload is few-shot machine translation (WMT16 En-De on LLaMA-13B): every prompt starts with the same
instruction and examples, a 1-shot prefix of 80 tokens or a 5-shot prefix of 341 tokens, followed by the sentence
to translate. vLLM computes the prefix's K/V once and maps every request's first logical blocks to those physical
blocks (the user marks the prefix, §4.4); Orca (Oracle) stores the prefix once per request. The paper reports
1.67x (1-shot) and 3.58x (5-shot) the throughput of Orca (Oracle).

Our workload (synthetic token ids with the paper's prefix lengths; the WMT16 sentences themselves are not at hand):
``prompt = prefix (80 or 341 tokens, the same for every request) + suffix`` where the suffix (framing + the source
sentence) is drawn uniformly from ``SUFFIX_RANGE`` = 16-48 tokens (mean 32) and the output (the translation) from
``OUTPUT_RANGE`` = 16-48 tokens (mean 32), generated to that length (``ignore_eos``). Every suffix is distinct, so
only the prefix can be shared.

Systems, all on the same KV budget in token slots:

- ``orca_oracle``: Orca (Oracle), a contiguous reservation of exactly prompt + output per request (buddy allocator);
- ``paged``: ours without any sharing (each request computes and stores its prefix);
- ``paged_user``: ours with the prefix marked by the user (the paper's mode: ``prefix_len``; its full blocks are
  computed once and pinned);
- ``paged_auto``: ours with automatic prefix caching (vLLM's later feature: chained block hashes, reuse of any
  cached full block, LRU eviction of unreferenced blocks); no marking needed.

Two scales, labelled in every table (``scale`` column):

- **cpu (real engine)**: ``LLMEngine`` on a small random-weight OPT on this machine's CPU, offline (every request
  queued at t = 0), wall-clock requests/s. Orca (Oracle) runs on the same engine through ``ContiguousKVManager``.
- **paper (sim)**: LLaMA-13B's KV (800 KB/token, like OPT-13B) on one A100-40GB (12 GB of KV = 15.7K token slots),
  the real scheduler and KV managers driven by ``sim.CostModel``'s roofline step time (``simulate_prefix`` below: a
  prefill is charged only for its uncached tokens). The claims use the paper's metric: each system's sustainable
  request rate (normalized latency at or below ``NL_THRESHOLD_S`` = 0.2 s/token, the one threshold of every figure
  judged by a sustainable rate here, ``capacity.NL_THRESHOLD_S``; bisection over the rate) over Orca (Oracle)'s, with
  the knee's ratio (``capacity.KNEE_FACTOR`` x the unloaded latency) and the ratio at 0.1 s/token recorded beside it
  (issue 61: the speedup moves with the threshold, so the threshold is the other figures', fixed in docs/METHOD.md
  before the rerun, not chosen per figure), with a band over the step-time constants
  (``pagedattn.repro.experiments.sensitivity``). Normalized latency against the Poisson request rate gives the shape of Fig. 16;
  offline throughput (every request at t = 0) is shown beside, not claimed: it measures capacity, not the rate
  served at equal latency.

The hit rate is the block manager's: the share of full prompt blocks looked up in the prefix cache that were found.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from pagedattn.repro.progress import interactive

from pagedattn.repro.experiments import sensitivity
from pagedattn.repro.paper import paper_slots
from pagedattn.repro.experiments import validated
from pagedattn.repro.experiments.common import Arrival, Clock, ServingParams, greedy, make_engine, replay, tiny_opt
from pagedattn.repro.sim.parallel import pmap
from pagedattn.repro.paper import FIG16_PREFIX
from pagedattn.repro.report.results import RESULTS_DIR, Claim, hardware_label, printed_interval, write_summary
from pagedattn.repro.experiments.sensitivity import widened
from pagedattn.repro.sim.capacity import KNEE_FACTOR, MAX_LENGTH_DOUBLINGS, NL_THRESHOLD_S, RESOLUTION, Load, \
    describe_ratio, length_agreed_rate, length_agreed_search, length_judged, ratio_resolution
from pagedattn.repro.sim.simulator import CostModel, normalized_latency, simulate
from pagedattn.repro.workloads.traces import TraceRequest, poisson_arrivals

EXPERIMENT = "07_shared_prefix"
SIM_MODEL = "sim: LLaMA-13B KV (800 KB/token) on A100-40GB (15.7K token slots, roofline step time with A100-measured constants)"
SHOTS = {name: v["prefix_len"] for name, v in FIG16_PREFIX.items()}  # one_shot: 80, five_shot: 341
SUFFIX_RANGE = (16, 48)  # tokens of the per-request part of the prompt (uniform, inclusive)
OUTPUT_RANGE = (16, 48)  # tokens generated per request (uniform, inclusive)
#: the systems Fig. 16 compares: Orca (Oracle) and the paged system of ``memory.systems.SYSTEMS`` with its three
#: ways of marking a shared prefix (``marked_prefix``)
COMPARED = ("orca_oracle", "paged", "paged_user", "paged_auto")
LABELS = {"orca_oracle": "Orca (Oracle)", "paged": "ours, no sharing", "paged_user": "ours, prefix marked by user",
          "paged_auto": "ours, automatic prefix caching"}
#: Fig. 16's speedup is the ratio of sustainable request rates (the paper's metric: request rate at equal normalized
#: latency, found by bisection over the rate) at ``NL_THRESHOLD_S``, ``capacity``'s 0.2 s/token, the threshold of
#: Figs. 12-14 and 17 (issue 61, docs/METHOD.md). Until issue 61 this notebook used its own, 0.1 s/token (about 3x
#: these short requests' unloaded latency, ~0.033 s/token); the table and the claims' notes still read it, recorded.
FORMER_NL_THRESHOLD_S = 0.1
NL_THRESHOLDS_S = (NL_THRESHOLD_S, FORMER_NL_THRESHOLD_S)


# ------------------------------------------------------------------------------------------------ workload
@dataclass(frozen=True)
class PrefixRequest:
    """One translation request: ``token_ids = prefix + suffix``; ``prefix_len`` tokens are the shared prefix."""

    request_id: str
    token_ids: tuple[int, ...]
    prefix_len: int
    output_len: int
    arrival_time: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)


def make_requests(prefix_len: int, num_requests: int, vocab_size: int = 32000, rate: float = math.inf,
                  seed: int = 0, suffix_range: tuple[int, int] = SUFFIX_RANGE,
                  output_range: tuple[int, int] = OUTPUT_RANGE) -> list[PrefixRequest]:
    """``num_requests`` prompts sharing one ``prefix_len``-token prefix, with distinct random suffixes and Poisson
    arrivals at ``rate`` requests/s (``inf``: all at t = 0). Token ids avoid 0-3 (special tokens)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(4, vocab_size, prefix_len).tolist()
    suffix_lens = rng.integers(suffix_range[0], suffix_range[1] + 1, num_requests)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, num_requests)
    out = []
    for i in range(num_requests):
        suffix = rng.integers(4, vocab_size, int(suffix_lens[i])).tolist()
        out.append(PrefixRequest(f"r{i}", tuple(prefix + suffix), prefix_len, int(output_lens[i]), 0.0))
    return out if math.isinf(rate) else with_rate(out, rate, seed)


def with_rate(reqs: list[PrefixRequest], rate: float, seed: int = 0) -> list[PrefixRequest]:
    """The same prompts with Poisson arrivals at ``rate`` (``workloads.poisson_arrivals``: seeded, the steady
    window receiving exactly ``rate``)."""
    arrivals = poisson_arrivals(len(reqs), rate, seed + 1)
    return [PrefixRequest(r.request_id, r.token_ids, r.prefix_len, r.output_len, float(t))
            for r, t in zip(reqs, arrivals)]


def ideal_hit_rate(reqs: list[PrefixRequest], block_size: int = 16, automatic: bool = True) -> float:
    """Hit rate if every request but the first finds the prefix's full blocks cached and nothing else hits.

    Automatic caching looks up every full prompt block; the user-marked mode only the prefix's full blocks."""
    pb = reqs[0].prefix_len // block_size
    looked = [(r.prompt_len // block_size if automatic else pb) for r in reqs]
    return (len(reqs) - 1) * pb / sum(looked) if sum(looked) else 0.0


# ---------------------------------------------------------------------------------------- systems
def marked_prefix(system: str, req: PrefixRequest) -> int:
    """The ``prefix_len`` a request carries: only the user-marked mode marks it."""
    return req.prefix_len if system == "paged_user" else 0


# ------------------------------------------------------------------------------------- paper scale (sim)
@dataclass
class PrefixSimResult:
    system: str
    requests: pd.DataFrame
    num_steps: int
    mean_batch: float
    hit_rate: float | None
    prefill_tokens_computed: int

    @property
    def duration(self) -> float:
        return float(self.requests["finish_time"].max() - self.requests["arrival_time"].min())

    def throughput(self) -> float:
        return len(self.requests) / self.duration

    def normalized_latency(self) -> float:
        return normalized_latency(self.requests)


def simulate_prefix(reqs: list[PrefixRequest], system: str, num_slots: int | None = None, block_size: int = 16,
                    cost: CostModel | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                    max_model_len: int = 2048, charge_cached: bool = False) -> PrefixSimResult:
    """Replay prompts with real token ids (so prefix hashes match) through ``sim.simulate``: the real
    ``Scheduler`` and KV manager of ``system``, a prefill charged only for the tokens whose K/V are not cached, a
    decode step the roofline of the running sequences' contexts (each sequence reads its whole context, shared
    blocks included, as the paged kernel does). ``charge_cached=True`` charges every prefill for its whole prompt
    (an ablation: sharing saves memory only)."""
    if system not in COMPARED:
        raise ValueError(f"unknown system {system!r}; known: {list(COMPARED)}")
    trace = [TraceRequest(r.request_id, r.arrival_time, len(r.token_ids), r.output_len) for r in reqs]
    res = simulate(trace, "orca_oracle" if system == "orca_oracle" else "paged", num_slots or paper_slots(),
                   block_size, cost or CostModel(), max_num_seqs, max_num_batched_tokens, max_model_len,
                   prompts={r.request_id: list(r.token_ids) for r in reqs},
                   prefix_lens={r.request_id: marked_prefix(system, r) for r in reqs},
                   enable_prefix_caching=system == "paged_auto", charge_cached=charge_cached)
    if res.requests["error"].notna().any():
        raise RuntimeError(f"{system}: a request can never fit ({res.requests['error'].dropna().iloc[0]})")
    return PrefixSimResult(system, res.requests, len(res.steps), res.mean_batch(), res.prefix_hit_rate,
                           res.prefill_tokens_computed)


# ---------------------------------------------------------------------------------------- cpu (real engine)
def run_engine(engine, reqs: list[PrefixRequest], system: str) -> dict:
    """Queue every request at t = 0, step until done (``common.replay`` on the wall clock); wall-clock throughput
    and the engine's counters."""
    clock = Clock(time.perf_counter)
    served = replay(engine, [Arrival(0.0, r.request_id, list(r.token_ids), greedy(r.output_len),
                                     {"prefix_len": marked_prefix(system, r)}) for r in reqs], clock)
    wall = served.duration
    m = engine.step_metrics_frame()
    dec = m[m.kind == "decode"]
    kv = engine.kv
    return {"wall_s": wall, "throughput_req_s": len(reqs) / wall,
            "tokens_per_s": sum(r.output_len for r in reqs) / wall,
            "mean_batch": float(dec.batch_size.mean()) if len(dec) else float("nan"),
            "num_steps": len(m), "prefill_tokens_computed": int(m.num_prefill_tokens.sum()),
            "hit_rate": kv.prefix_hit_rate if system != "orca_oracle" and kv.prefix_queries else None,
            "outputs": {rid: o.outputs[0].token_ids for rid, o in served.outputs.items()}}


# --------------------------------------------------------------------------------------------- the run
@dataclass
@validated
class Params(ServingParams):
    # paper scale (sim)
    sim_requests: int = 1000
    #: the rate searches' trace (Fig. 16's speedup): 1,000 requests left the five-shot paged searches at 0.2 s/token
    #: unjudged (``capacity.Load.trend_se`` 1.1 % of the rate, above half the 2 % margin); the capacity rule asks for
    #: a longer trace then
    search_requests: int = 2000
    sim_rates: dict = field(default_factory=lambda: {"one_shot": [5, 10, 15, 20, 25, 30, 40, 50, 60, 70, 80, 100],
                                                     "five_shot": [3, 6, 9, 12, 15, 20, 25, 30, 35, 40, 50, 60]})
    # cpu scale (real engine)
    cpu_requests: int = 48
    cpu_slots: int = 2048
    cpu_vocab: int = 512
    cpu_hidden: int = 128
    cpu_layers: int = 4
    cpu_repeats: int = 3  # wall-clock runs per system; the fastest is kept
    rate_resolution: float = RESOLUTION  # sustainable-rate search (Fig. 16's metric; ``capacity``)
    #: the trace-length rule's most doublings (``capacity.length_agreed_search``); a quick run (a smoke test, whose
    #: short traces are rarely long enough to be judged) stops at one: n and 2n
    max_length_doublings: int = MAX_LENGTH_DOUBLINGS

    # a quick run is a smoke test of every path (issue 64), not a measurement: shorter simulated traces (the
    # searches' too) and fewer CPU-engine requests
    QUICK = dict(sim_requests=100, search_requests=100, sim_rates={"one_shot": [10, 30, 60], "five_shot": [5, 15, 40]},
                 cpu_requests=6, cpu_repeats=1, rate_resolution=0.25, max_length_doublings=1)


# The sim's replays below run in parallel (``pagedattn.repro.sim.parallel.pmap``): each task rebuilds its requests from the
# seed (``make_requests``, deterministic) rather than carrying ~1000 prompts of token ids to a worker.
def _offline_row(job: tuple, params: Params) -> dict:
    """One replay of ``sim_offline``: ``(shot, system)``."""
    shot, s = job
    reqs = make_requests(SHOTS[shot], params.sim_requests, seed=params.seed)
    res = simulate_prefix(reqs, s, block_size=params.block_size)
    return {"scale": "paper (sim)", "shot": shot, "prefix_len": SHOTS[shot], "system": s,
            "label": LABELS[s], "throughput_req_s": res.throughput(),
            "tokens_per_s": res.requests["output_len"].sum() / res.duration, "mean_batch": res.mean_batch,
            "hit_rate": res.hit_rate, "ideal_hit_rate": ideal_hit_rate(reqs, params.block_size, s == "paged_auto")
            if s in ("paged_user", "paged_auto") else None,
            "prefill_tokens_computed": res.prefill_tokens_computed, "num_steps": res.num_steps}


def sim_offline(params: Params, progress: bool = True) -> pd.DataFrame:
    """Paper scale, every request queued at t = 0: requests/s, mean batch, hit rate."""
    jobs = [(shot, s) for shot in SHOTS for s in COMPARED]
    rows = pmap(partial(_offline_row, params=params), jobs, "offline (sim)", progress)
    return _with_speedup(pd.DataFrame(rows), "throughput_req_s")


def _offline_throughput(job: tuple, params: Params) -> tuple[float, float]:
    """One replay of ``sim_ablation``: ``(shot, system, charge_cached)`` -> (throughput, mean batch)."""
    shot, s, charge = job
    r = simulate_prefix(make_requests(SHOTS[shot], params.sim_requests, seed=params.seed), s,
                        block_size=params.block_size, charge_cached=charge)
    return r.throughput(), r.mean_batch


def sim_ablation(params: Params, progress: bool = False) -> pd.DataFrame:
    """Where the gain comes from (paper scale, offline): the user-marked prefix with its cached prefill tokens
    charged anyway (memory saving only) next to the normal run (memory and prefill compute saved)."""
    jobs = [(shot, s, charge) for shot in SHOTS for s, charge in (("orca_oracle", False), ("paged_user", True),
                                                                   ("paged_user", False))]
    res = dict(zip(jobs, pmap(partial(_offline_throughput, params=params), jobs, "ablation (sim)", progress)))
    rows = []
    for shot in SHOTS:
        base = res[(shot, "orca_oracle", False)][0]
        for charge in (True, False):
            throughput, mean_batch = res[(shot, "paged_user", charge)]
            rows.append({"scale": "paper (sim)", "shot": shot, "system": "paged_user",
                         "variant": "memory saving only (prefix prefill charged)" if charge
                         else "memory + prefill compute saved",
                         "throughput_req_s": throughput, "mean_batch": mean_batch,
                         "speedup_vs_orca_oracle": throughput / base})
    return pd.DataFrame(rows)


def sim_online(params: Params, progress: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Paper scale, Poisson arrivals: normalized latency vs request rate (Fig. 16's axes), and for each system the
    highest swept rate whose normalized latency stays <= each threshold and that passes the capacity rule
    (``capacity.Load.keeps_up``; read off the curve, no bisection)."""
    jobs = [(shot, rate, s) for shot, rates in params.sim_rates.items() for rate in rates for s in COMPARED]
    online = pd.DataFrame(pmap(partial(_online_row, params=params), jobs, "online (sim)", progress))
    sus = []
    for threshold in NL_THRESHOLDS_S:
        for (shot, s), d in online.groupby(["shot", "system"], sort=False):
            ok = d[(d.normalized_latency_s <= threshold) & d.keeps_up]["rate"]
            sus.append({"scale": "paper (sim)", "shot": shot, "system": s, "label": LABELS[s],
                        "threshold_s": threshold, "sustainable_rate": float(ok.max()) if len(ok) else float("nan"),
                        "at_top_of_sweep": bool(len(ok)) and float(ok.max()) == float(d["rate"].max())})
    sus = pd.DataFrame(sus)
    base = sus[sus.system == "orca_oracle"].set_index(["shot", "threshold_s"])["sustainable_rate"]
    sus["speedup_vs_orca_oracle"] = sus["sustainable_rate"] / [base[(a, b)] for a, b in zip(sus.shot, sus.threshold_s)]
    return online, sus


def _online_row(job: tuple, params: Params) -> dict:
    """One replay of ``sim_online``: ``(shot, rate, system)``."""
    shot, rate, s = job
    reqs = make_requests(SHOTS[shot], params.sim_requests, seed=params.seed)
    res = simulate_prefix(with_rate(reqs, rate, params.seed), s, block_size=params.block_size)
    load = Load.of(res.requests)
    return {"scale": "paper (sim)", "shot": shot, "rate": rate, "system": s, "label": LABELS[s],
            "normalized_latency_s": res.normalized_latency(), "mean_batch": res.mean_batch,
            "throughput_req_s": load.completion_rate, "keeps_up": load.keeps_up()}


def _requests(rate: float, n: int, shot: str, system: str, params: Params, cost: CostModel | None,
              memo: dict[tuple[float, int], pd.DataFrame]) -> pd.DataFrame:
    """The per-request frame of one replay at ``rate`` (a bisection's probe), remembered in ``memo``: the
    bisections at each threshold start from the same bounds and midpoints, and a replay is deterministic."""
    if (rate, n) not in memo:
        reqs = make_requests(SHOTS[shot], n, seed=params.seed)
        memo[rate, n] = simulate_prefix(with_rate(reqs, rate, params.seed), system, block_size=params.block_size,
                                        cost=cost).requests
    return memo[rate, n]


def _rate_ratio_rows(job: tuple, thresholds: tuple, params: Params, cost: CostModel | None) -> list[dict]:
    """The bisections of ``sim_rate_ratios`` for one ``(shot, system)``, one per threshold, sharing their replays
    at equal rates."""
    shot, s = job
    rates = params.sim_rates[shot]
    lo, hi = min(rates) / 4, max(rates) * 4
    replay = partial(_requests, shot=shot, system=s, params=params, cost=cost, memo={})
    rows = []
    for thr in thresholds:  # the trace-length rule (``capacity.length_agreed_rate``) from ``search_requests``
        key = {"fn": "shared_prefix.rate_ratios", "shot": shot, "system": s, "lo": lo, "hi": hi, "threshold_s": thr,
               "params": asdict(params), "cost": None if cost is None else asdict(cost), "knee": thr == NL_THRESHOLD_S}
        found = sensitivity.cached_search(key, lambda: length_agreed_search(
            replay, params.search_requests, lo, hi, thr, params.rate_resolution,
            max_doublings=params.max_length_doublings, knee=thr == NL_THRESHOLD_S)).row()
        rows.append({"scale": "paper (sim)", "shot": shot, "system": s, "label": LABELS[s], "threshold_s": thr,
                     **found})
    return rows


def sim_rate_ratios(params: Params, cost: CostModel | None = None, thresholds=NL_THRESHOLDS_S,
                    systems=("orca_oracle", "paged_user", "paged_auto"), progress: bool = True) -> pd.DataFrame:
    """Fig. 16 on the paper's metric: each system's sustainable request rate (the highest rate whose normalized
    latency stays at or below the threshold; bisection over the rate, ``capacity.length_agreed_rate``) and its ratio
    to Orca (Oracle)'s, per shot and threshold."""
    jobs = [(shot, s) for shot in SHOTS for s in systems]  # each: a bisection per threshold (in parallel)
    found = dict(zip(jobs, pmap(partial(_rate_ratio_rows, thresholds=tuple(thresholds), params=params, cost=cost),
                                jobs, "sustainable rate (sim)", progress)))
    df = pd.DataFrame([found[(shot, s)][i] for shot in SHOTS for i in range(len(thresholds)) for s in systems])
    base_rate = df[df.system == "orca_oracle"].set_index(["shot", "threshold_s"])["sustainable_rate"]
    df["speedup_vs_orca_oracle"] = df["sustainable_rate"] / [base_rate[(a, b)] for a, b in zip(df.shot, df.threshold_s)]
    return df


def cpu_offline(params: Params, progress: bool = True) -> pd.DataFrame:
    """CPU scale: the real engine on a small random-weight OPT, every request queued at t = 0, wall clock.

    Each (shot, system) is run ``cpu_repeats`` times, each on a fresh engine, and the fastest run is kept. The
    greedy outputs of every system must agree token for token (sharing changes where K/V live, not what they are)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: on a shared 2-core machine more threads oversubscribe and times explode
    try:
        return _cpu_offline(params, progress)
    finally:
        torch.set_num_threads(threads)


def cpu_engine(model, system: str, params: Params):
    """An ``LLMEngine`` serving as ``system`` (``common.make_engine``) on ``cpu_slots`` token slots, up to the
    model's positions."""
    return make_engine(model, system, params.cpu_slots, params.block_size, model.config.max_position_embeddings)


def _cpu_offline(params: Params, progress: bool) -> pd.DataFrame:
    import torch

    model = tiny_opt(vocab_size=params.cpu_vocab, hidden_size=params.cpu_hidden, num_hidden_layers=params.cpu_layers)
    warm = make_requests(16, 2, params.cpu_vocab, seed=99)
    run_engine(cpu_engine(model, "paged", params), warm, "paged")  # warm-up
    rows = []
    jobs = [(shot, s, k) for shot in SHOTS for k in range(params.cpu_repeats) for s in COMPARED]
    reference: dict[str, dict] = {}
    with torch.inference_mode():
        for shot, s, k in tqdm(jobs, desc="offline (cpu engine)", disable=not (progress and interactive()), leave=False):
            reqs = make_requests(SHOTS[shot], params.cpu_requests, params.cpu_vocab, seed=params.seed)
            r = run_engine(cpu_engine(model, s, params), reqs, s)
            outputs = r.pop("outputs")
            ref = reference.setdefault(shot, outputs)
            rows.append({"scale": "cpu (real engine)", "shot": shot, "prefix_len": SHOTS[shot], "system": s,
                         "label": LABELS[s], "repeat": k, "same_outputs": outputs == ref, **r})
    df = pd.DataFrame(rows)
    best = df.loc[df.groupby(["shot", "system"], sort=False)["wall_s"].idxmin()].drop(columns="repeat")
    best["same_outputs"] = df.groupby(["shot", "system"], sort=False)["same_outputs"].all().values
    return _with_speedup(best.reset_index(drop=True), "throughput_req_s")


def _with_speedup(df: pd.DataFrame, col: str) -> pd.DataFrame:
    """Add ``speedup_vs_orca_oracle``: each row's ``col`` over Orca (Oracle)'s for the same shot."""
    base = df[df.system == "orca_oracle"].set_index("shot")[col]
    return df.assign(speedup_vs_orca_oracle=df[col] / df["shot"].map(base))


def claims(sim: pd.DataFrame, cpu: pd.DataFrame | None, ratios: pd.DataFrame) -> list[Claim]:
    """Fig. 16's speedups on the paper's metric (sustainable request rate at ``NL_THRESHOLD_S``, paper scale),
    judged two-sided (the paper's value widened by 25 %), automatic caching's, and the hit rates (offline runs)."""
    out = []
    s = sim.set_index(["shot", "system"])
    r = ratios.set_index(["shot", "threshold_s", "system"])
    c = cpu.set_index(["shot", "system"]) if cpu is not None else None
    for shot in SHOTS:
        paper = FIG16_PREFIX[shot]["speedup"]
        user = float(r.loc[(shot, NL_THRESHOLD_S, "paged_user"), "speedup_vs_orca_oracle"])
        others = {t: float(r.loc[(shot, t, "paged_user"), "speedup_vs_orca_oracle"]) for t in NL_THRESHOLDS_S
                  if t != NL_THRESHOLD_S and (shot, t, "paged_user") in r.index}
        a, b = widened(paper)
        note = (f"paper scale (sim), sustainable request rate at {NL_THRESHOLD_S} s/token (every figure's threshold, "
                f"fixed in METHOD before the rerun) and the capacity rule, over Orca (Oracle); {SHOTS[shot]}-token "
                "prefix; "
                + "".join(f"at {t} s/token: {v:.2f}x; " for t, v in others.items())
                + f"offline throughput: {float(s.loc[(shot, 'paged_user'), 'speedup_vs_orca_oracle']):.2f}x")
        note += "; " + describe_ratio(r.loc[(shot, NL_THRESHOLD_S, "paged_user")],
                                      r.loc[(shot, NL_THRESHOLD_S, "orca_oracle")])
        if r.loc[(shot, NL_THRESHOLD_S, "paged_user"), "at_upper_bound"]:
            note += " (ours at the top of the search: a lower bound)"
        if c is not None:
            note += f"; cpu real engine (offline): {float(c.loc[(shot, 'paged_user'), 'speedup_vs_orca_oracle']):.2f}x"
        judged = length_judged(r.loc[(shot, NL_THRESHOLD_S, "paged_user")], r.loc[(shot, NL_THRESHOLD_S, "orca_oracle")])
        out.append(Claim(f"prefix_speedup.{shot}", paper, round(user, 2), "x", f"{a:.3g}-{b:.3g}",
                         bool(a <= user <= b) if judged else None, note, accept=[a, b],
                         strict=printed_interval(paper)))
        knee = r.loc[[(shot, NL_THRESHOLD_S, x) for x in ("paged_user", "orca_oracle")], "knee_rate"] \
            if "knee_rate" in r else pd.Series(dtype=float)
        if len(knee) == 2 and float(knee.iloc[1]) > 0 and math.isfinite(float(knee.iloc[0])):
            out.append(Claim(f"prefix_speedup.{shot}.knee", paper, round(float(knee.iloc[0] / knee.iloc[1]), 2), "x",
                             "", None, f"recorded beside prefix_speedup.{shot}: the ratio of the knee rates (the "
                             f"highest rate whose normalized latency stays within {KNEE_FACTOR:g}x the unloaded one, "
                             f"the paper's reading of a curve); {float(knee.iloc[0]):.3g} / {float(knee.iloc[1]):.3g} "
                             "req/s", kind="tracking"))
        if (shot, NL_THRESHOLD_S, "paged_auto") in r.index:
            auto = float(r.loc[(shot, NL_THRESHOLD_S, "paged_auto"), "speedup_vs_orca_oracle"])
            note = f"paper scale (sim), sustainable request rate at {NL_THRESHOLD_S} s/token, over Orca (Oracle)"
            if c is not None:
                note += f"; cpu real engine (offline): {float(c.loc[(shot, 'paged_auto'), 'speedup_vs_orca_oracle']):.2f}x"
            # both rates are searched to a resolution: equal true rates may be found up to their ratio's apart
            res = ratio_resolution(r.loc[(shot, NL_THRESHOLD_S, "paged_auto")],
                                   r.loc[(shot, NL_THRESHOLD_S, "paged_user")])
            out.append(Claim(f"prefix_speedup_auto.{shot}", f">= prefix_speedup.{shot}", round(auto, 2), "x",
                             f">= user-marked ({user:.2f}x) within the ratio's resolution ({100 * res:.1f} %)",
                             bool(auto * (1 + res) >= user - 1e-9),
                             note + "; holds by construction (automatic caching finds at least the marked prefix), "
                                    "not a paper claim", kind="invariant"))
        if (shot, "paged_auto") in s.index:
            hit, ideal = s.loc[(shot, "paged_auto"), "hit_rate"], s.loc[(shot, "paged_auto"), "ideal_hit_rate"]
            out.append(Claim(f"prefix_hit_rate.{shot}", None, round(100 * float(hit), 2), "%",
                             f">= 0.99 x ideal ({100 * ideal:.1f} %)", bool(hit >= 0.99 * ideal),
                             "automatic caching, paper scale (sim), offline; ideal = every request but the first finds "
                             "the prefix's full blocks, nothing else hits (suffixes are distinct, so this holds by "
                             "construction of the workload); the paper gives no hit rate", kind="invariant"))
    return out


def claims_at(point: sensitivity.Point, params: Params) -> list[Claim]:
    """Fig. 16's speedup claims under one point's step-time assumptions: the band's evaluation (a search over rates,
    so no rate axis; a synthetic workload, so no trace axis)."""
    ratios = sim_rate_ratios(params, point.cost(), (NL_THRESHOLD_S,), ("orca_oracle", "paged_user"), False)
    sim = pd.DataFrame([{"shot": shot, "system": "paged_user", "speedup_vs_orca_oracle": math.nan}
                        for shot in SHOTS])
    return [c for c in claims(sim, None, ratios) if c.name.startswith("prefix_speedup.")]


def run(quick: bool = False, results_dir: str | Path = RESULTS_DIR, progress: bool = True, cpu: bool = True,
        **kw) -> dict:
    """Run both scales; write CSVs and ``summary.json`` to ``<results_dir>/07_shared_prefix/``; return the tables."""
    params = Params.make(quick, **kw)
    out_dir = Path(results_dir) / EXPERIMENT
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tables = {"sim_offline": sim_offline(params, progress), "sim_ablation": sim_ablation(params)}
    tables["sim_online"], tables["sim_sustainable"] = sim_online(params, progress)
    tables["sim_rate_ratios"] = sim_rate_ratios(params, progress=progress)
    t_sim = time.perf_counter() - t0
    if cpu:
        tables["cpu_offline"] = cpu_offline(params, progress)
    t_cpu = time.perf_counter() - t0 - t_sim
    for name, df in tables.items():
        df.to_csv(out_dir / f"{name}.csv", index=False)
    hw = hardware_label("cpu")
    model = (f"{SIM_MODEL}; cpu: random-weight OPT ({params.cpu_layers} layers, hidden {params.cpu_hidden}, "
             f"vocab {params.cpu_vocab}), {params.cpu_slots} token slots")
    default = claims(tables["sim_offline"], tables.get("cpu_offline"), tables["sim_rate_ratios"])
    pts = sensitivity.points(quick, rate_axis=False, trace_axis=False)
    tables["sensitivity"] = sensitivity.sweep(EXPERIMENT, partial(claims_at, params=params), pts,
                                              {"params": asdict(params)}, default, progress=progress)
    tables["sensitivity"].to_csv(out_dir / "sensitivity.csv", index=False)
    write_summary(out_dir, EXPERIMENT, hw, model, quick,
                  sensitivity.with_bands(default, tables["sensitivity"], sensitivity.describe(pts)),
                  extra={"params": asdict(params), "cost_model": asdict(CostModel()),
                         "suffix_range": SUFFIX_RANGE, "output_range": OUTPUT_RANGE,
                         "runtime_s": {"sim": round(t_sim, 1), "cpu": round(t_cpu, 1)}})
    tables["label"] = (f"paper scale: {SIM_MODEL} | cpu scale: random OPT on {hw} | quick={quick}")
    tables["out_dir"] = out_dir
    tables["params"] = params
    return tables
