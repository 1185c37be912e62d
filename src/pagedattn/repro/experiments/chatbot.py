"""Experiment 09: the chatbot workload (paper §6.5, Fig. 17).

A chatbot sends the whole conversation so far with every user turn. Following §6.5, each request is one round of a
real multi-round ShareGPT conversation: the prompt is the chat history plus the last user turn, cut to its last
1024 tokens; the model generates at most 1024 tokens (the reply's real length, cut to 1024); no KV cache is kept
between rounds, so rounds are independent requests (``workloads`` trace ``"sharegpt_chat"``, OPT tokens). Rounds are
sampled with a seed and arrive as a Poisson process.

The paper (OPT-13B on one A100-40GB) reports that ours sustains 2x the request rate of the three Orca baselines,
which perform alike: the long prompts leave every system the same few slots, and the buddy allocator rounds most
Oracle and Pow2 reservations to the same power of two. We replay that setting with the simulated executor
(``sim.py``, 15.7K token slots) and find each system's sustainable rate with the same rule as notebook 03 (the
highest rate whose normalized latency stays at or below ``NL_THRESHOLD_S``, by bisection). The ratios carry
sensitivity bands over the step-time constants (``pagedattn.repro.experiments.sensitivity``): they come from a search over rates, so
there is no rate axis, and the chatbot rounds exist only as real conversations, so there is no trace axis.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import pandas as pd

from pagedattn.repro.experiments import sensitivity
from pagedattn.repro.paper import paper_slots
from pagedattn.repro.experiments import validated
from pagedattn.repro.experiments.common import ServingParams
from pagedattn.repro.sim.capacity import MAX_LENGTH_DOUBLINGS, NL_THRESHOLD_S, RESOLUTION, describe_ratio, length_agreed_search, length_judged
from pagedattn.repro.experiments.throughput import base_trace
from pagedattn.repro.sim.parallel import pmap
from pagedattn.repro.paper import FIG17_RATE_RATIO
from pagedattn.repro.report.results import RESULTS_DIR, Claim, hardware_label, printed_interval, write_summary
from pagedattn.repro.sim.simulator import ITERATION_LEVEL, LABELS, CostModel, simulate
from pagedattn.repro.workloads.traces import describe_trace, make_trace, trace_stats, with_rate

EXPERIMENT = "09_chatbot"
MODEL = "sim: OPT-13B/A100-40GB (15.7K token slots, roofline step time with A100-measured constants)"
TRACE = "sharegpt_chat"
#: Tolerances, fixed before the first run: the 2x within +-30 %; "alike" as within 25 % of each other.
RATIO_BAND = (1.4, 2.6)
ALIKE_BAND = (0.8, 1.25)


@dataclass
@validated
class Params(ServingParams):
    num_requests: int = 1000
    rates: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
    rate_resolution: float = RESOLUTION  # the sustainable-rate search's (``capacity``)
    #: the trace-length rule's most doublings (``capacity.length_agreed_search``); a quick run (a smoke test, whose
    #: short traces are rarely long enough to be judged) stops at one: n and 2n
    max_length_doublings: int = MAX_LENGTH_DOUBLINGS

    QUICK = dict(num_requests=150, rates=(0.5, 1.0, 2.0), rate_resolution=0.25, max_length_doublings=1)


def run_at(base, rate: float, system: str, params: Params, record_steps: bool = True,
           cost: CostModel | None = None):
    return simulate(with_rate(base, rate, params.seed), system, paper_slots(), params.block_size, cost or CostModel(),
                    record_steps=record_steps)


def _curve_row(job: tuple, base, params: Params) -> dict:
    rate, s = job
    res = run_at(base, rate, s, params)
    return {"rate": rate, "system": s, "label": LABELS[s], "normalized_latency_s": res.normalized_latency(),
            "mean_batch": res.mean_batch(), "preemptions": sum(res.num_preemptions.values())}


def latency_curves(base, params: Params, progress: bool = True) -> pd.DataFrame:
    """Normalized latency and mean batch of every system at every rate (Fig. 17); the replays run in parallel
    (``pagedattn.repro.sim.parallel``)."""
    jobs = [(r, s) for r in params.rates for s in ITERATION_LEVEL]
    return pd.DataFrame(pmap(partial(_curve_row, base=base, params=params), jobs, "chatbot (sim)", progress))


def _requests(rate: float, n: int, base, system: str, params: Params, cost: CostModel | None) -> pd.DataFrame:
    """The per-request frame of one replay of the ``n``-request trace at ``rate`` (a bisection's probe; ``base``
    where it has ``n`` requests)."""
    trace = base if n == len(base) else base_trace(TRACE, n, params.seed)
    return run_at(trace, rate, system, params, False, cost).requests


def _sustainable_row(s: str, base, params: Params, cost: CostModel | None) -> dict:
    """One system's searches (``capacity.length_agreed_rate``: latency threshold, capacity rule, the trace-length
    rule from ``base``'s length, and the knee)."""
    lo, hi = min(params.rates) / 4, max(params.rates) * 8
    key = {"fn": "chatbot.sustainable", "base": sensitivity.trace_digest(base), "system": s, "lo": lo, "hi": hi,
           "threshold_s": NL_THRESHOLD_S, "params": asdict(params), "cost": asdict(cost or CostModel()), "knee": True}
    found = sensitivity.cached_search(key, lambda: length_agreed_search(
        partial(_requests, base=base, system=s, params=params, cost=cost), len(base), lo, hi, NL_THRESHOLD_S,
        params.rate_resolution, max_doublings=params.max_length_doublings, knee=True)).row()
    return {"system": s, "label": LABELS[s], **found, "threshold_s": NL_THRESHOLD_S}


def sustainable(base, params: Params, progress: bool = True, cost: CostModel | None = None) -> pd.DataFrame:
    """Each system's sustainable rate; the bisections (one per system, each sequential) run in parallel."""
    return pd.DataFrame(pmap(partial(_sustainable_row, base=base, params=params, cost=cost), ITERATION_LEVEL,
                             "sustainable rate", progress))


def claims(sus: pd.DataFrame) -> list[Claim]:
    rows = sus.set_index("system")
    r = rows["sustainable_rate"]
    note = f"{describe_trace(TRACE)}; sim at paper scale; NL threshold {NL_THRESHOLD_S} s/token and the capacity rule"
    out = []
    for other in ("orca_oracle", "orca_pow2", "orca_max"):
        ratio = float(r["paged"] / r[other])
        lo, hi = RATIO_BAND
        out.append(Claim(f"rate_ratio.chatbot.paged_vs_{other}", FIG17_RATE_RATIO, round(ratio, 2), "x",
                         f"{lo}-{hi}", bool(lo <= ratio <= hi)
                         if length_judged(rows.loc["paged"], rows.loc[other]) else None,
                         note=f"{note}; {describe_ratio(rows.loc['paged'], rows.loc[other])}",
                         accept=[lo, hi], strict=printed_interval(f"{FIG17_RATE_RATIO:g}")))
    ratio = float(r["orca_max"] / r["orca_oracle"])
    lo, hi = ALIKE_BAND
    out.append(Claim("rate_ratio.chatbot.orca_max_vs_orca_oracle", 1.0, round(ratio, 2), "x", f"{lo}-{hi}",
                     bool(lo <= ratio <= hi) if length_judged(rows.loc["orca_max"], rows.loc["orca_oracle"]) else None,
                     note="paper: the three Orca variants perform alike; " + note +
                     f"; {describe_ratio(rows.loc['orca_max'], rows.loc['orca_oracle'])}", accept=[lo, hi]))
    return out


def claims_at(point: sensitivity.Point, base, params: Params) -> list[Claim]:
    """Fig. 17's claims under one point's step-time assumptions (the band's evaluation)."""
    return claims(sustainable(base, params, progress=False, cost=point.cost()))


def band_search(job: tuple, base, params: Params) -> None:
    """One search of the band, ``(system, point)``, stored in the search cache as ``claims_at`` asks for it
    (``sensitivity.prefetch``: in a full run, the band's 24 searches as 24 tasks, not six points of four each)."""
    system, point = job
    _sustainable_row(system, base, params, point.cost())


def run(quick: bool = False, results_dir: str | Path = RESULTS_DIR, progress: bool = True, **kw) -> dict:
    """Run Fig. 17, write CSVs and ``summary.json`` to ``<results_dir>/09_chatbot/``; return the tables."""
    params = Params.make(quick, **kw)
    out_dir = Path(results_dir) / EXPERIMENT
    out_dir.mkdir(parents=True, exist_ok=True)
    base = make_trace(TRACE, params.num_requests, 1.0, params.seed)
    tables = {"fig17_latency": latency_curves(base, params, progress),
              "sustainable": sustainable(base, params, progress),
              "trace": pd.DataFrame([{"trace": TRACE, "source": describe_trace(TRACE), **trace_stats(base)}])}
    for name, df in tables.items():
        df.to_csv(out_dir / f"{name}.csv", index=False)
    hw = hardware_label("sim")
    pts = sensitivity.points(quick, rate_axis=False, trace_axis=False)
    sensitivity.prefetch(partial(band_search, base=base, params=params),
                         [(s, p) for p in pts if not p.is_default for s in ITERATION_LEVEL], "chatbot band searches",
                         progress)
    tables["sensitivity"] = sensitivity.sweep(EXPERIMENT, partial(claims_at, base=base, params=params), pts,
                                              {"params": asdict(params)}, claims(tables["sustainable"]),
                                              progress=progress)
    tables["sensitivity"].to_csv(out_dir / "sensitivity.csv", index=False)
    bands = sensitivity.with_bands(claims(tables["sustainable"]), tables["sensitivity"], sensitivity.describe(pts))
    write_summary(out_dir, EXPERIMENT, hw, MODEL, quick, bands,
                  extra={"params": asdict(params), "cost_model": asdict(CostModel()), "trace": describe_trace(TRACE),
                         "nl_threshold_s": NL_THRESHOLD_S})
    tables["label"] = f"{MODEL} | {hw} | {params.num_requests} rounds | quick={quick}"
    tables["out_dir"] = out_dir
    return tables
