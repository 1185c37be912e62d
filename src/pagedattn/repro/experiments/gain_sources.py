"""Where Fig. 14's gains and Fig. 15's savings come from: measurements that explain (or fail to explain) the claims of
notebooks 04 and 11 that miss the paper (paper §6.3, Figs. 14-15; issue 30 part 5).

Four small measurements, each a few replays of the paper-scale simulator (OPT-13B / A100-40GB, 15.7K slots, Alpaca
unless named), parallel through ``pagedattn.repro.sim.parallel.pmap``:

- ``n1_gain_sources``: Fig. 14a at n = 1. Both systems replayed at their own sustainable rates and ours at Orca
  (Oracle)'s; ``decode_terms`` splits each run's decode throughput into an exact product (batch x 1 / step time x
  decode share of time) and its KV memory into token states / reserved (future tokens of a reservation) / internal /
  external (free or buddy rounding) slots, so that the gain's factors can be read off (``n1_gain_factors``).
- ``parallel_saving_causes``: Fig. 15's parallel-sampling saving under its two candidate causes of a low n = 2 value:
  the independent per-sample output lengths (``sim.simulate(equal_sample_lengths=True)`` removes them) and the
  averaging (time-weighted by step duration, as notebook 04 reports, or per step).
- ``beam_saving_vs_parents``: Fig. 15's beam saving under ``sim.BeamModel`` as the mean distinct parents per step
  moves; ``parents_for_saving`` finds the branching that gives a target saving (the paper's).
- ``seq_cap_gains``: Fig. 14's gains, n = 1 and every beam width, with the scheduler's ``max_num_seqs`` raised.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
import pandas as pd

from pagedattn.config import paper_slots
from pagedattn.repro.experiments import sharing
from pagedattn.repro.sim.parallel import pmap
from pagedattn.repro.sim.simulator import BeamModel, CostModel, SimResult, simulate
from pagedattn.repro.workloads.traces import make_trace, with_rate

#: KV slot kinds of ``SimResult.steps`` (``memory.accounting.KVStats``)
SLOT_KINDS = ("token_states", "reserved", "internal", "external")
#: the scheduler's cap on running sequences raised to a value no Fig. 14 run reaches (``seq_cap_gains``, notebook 11)
LIFTED_SEQ_CAP = 2048


# ------------------------------------------------------------------------------------------- Fig. 14a, n = 1
def decode_terms(r: SimResult) -> dict:
    """One replay's decode throughput and KV memory over its steady window (§6.3's comparison at a fixed rate).

    Decode tokens per second is exactly ``batch_per_step x steps_per_s x decode_time_share``: the mean running
    sequences per decode step, one over the mean decode step time, and the decode steps' share of the window's time
    (the rest is prefill). ``*_pct`` is the time-weighted share of KV slots of each kind over *all* steady steps
    (``SimResult.shares(memory_bound_only=False)``): token states, reserved (slots a reservation holds for its future
    tokens), internal, external (free, or a buddy block's rounding). ``context_per_seq`` is token-state slots per
    running sequence on decode steps."""
    start, end = r.steady_window()
    d = r.steps[(r.steps["time"] >= start) & (r.steps["time"] < end)]
    dec = d[d["kind"] == "decode"]
    batch = float(dec["num_running"].mean())
    dt = float(dec["dt"].mean())
    share = float(dec["dt"].sum() / d["dt"].sum())
    load = r.load()
    return {"batch_per_step": batch, "decode_step_ms": 1000 * dt, "decode_time_share": share,
            "decode_tokens_per_s": batch / dt * share,
            **{f"{k}_pct": v for k, v in r.shares(memory_bound_only=False).items()},
            "context_per_seq": float(dec["token_states"].sum() / dec["num_running"].sum()),
            "memory_bound_share": r.memory_bound_share(), "preemptions": int(sum(r.num_preemptions.values())),
            "normalized_latency_s": load.normalized_latency_s, "completion_rate": load.completion_rate}


def n1_gain_sources(sp: sharing.Params, rate_paged: float, rate_orca: float, cost: CostModel | None = None,
                    progress: bool = True) -> pd.DataFrame:
    """Fig. 14a at n = 1 (§6.3): ours and Orca (Oracle) each at its own sustainable rate, and ours at Orca's, on
    the n = 1 Alpaca trace with swap preemption (as ``sharing.sim_rate``); one row of ``decode_terms`` each."""
    jobs = [("paged", rate_paged, "own"), ("orca_oracle", rate_orca, "own"), ("paged", rate_orca, "orca_oracle's")]
    rows = pmap(partial(_n1_row, sp=sp, cost=cost or CostModel()), jobs, "n=1 gain sources", progress)
    return pd.DataFrame(rows)


def _n1_row(job: tuple, sp: sharing.Params, cost: CostModel) -> dict:
    system, rate, which = job
    trace = with_rate(make_trace("alpaca", sp.gain_requests_n1, 1.0, sp.seed), rate, sp.seed)
    r = simulate(trace, system, paper_slots(), sp.block_size, cost, seed=sp.seed, preemption_mode="swap",
                 num_cpu_blocks=sp.sim_cpu_blocks)
    return {"system": system, "at_rate": which, "rate": rate, **decode_terms(r)}


def n1_gain_factors(sources: pd.DataFrame) -> pd.Series:
    """Ours over Orca (Oracle), each at its own sustainable rate (rows of ``n1_gain_sources``): the rate ratio
    (the gain), the decode-throughput ratio and its three exact factors, and the batch ratio split into the
    token-state share of memory over the context per sequence (batch = token-state slots / context per sequence,
    on the same memory)."""
    own = sources[sources["at_rate"] == "own"].set_index("system")
    p, o = own.loc["paged"], own.loc["orca_oracle"]
    return pd.Series({
        "gain (rate ratio)": p["rate"] / o["rate"],
        "decode tokens/s ratio": p["decode_tokens_per_s"] / o["decode_tokens_per_s"],
        "batch ratio": p["batch_per_step"] / o["batch_per_step"],
        "step-rate ratio (Orca step time / ours)": o["decode_step_ms"] / p["decode_step_ms"],
        "decode time share ratio": p["decode_time_share"] / o["decode_time_share"],
        "token-state share ratio": p["token_states_pct"] / o["token_states_pct"],
        "context per sequence ratio (Orca / ours)": o["context_per_seq"] / p["context_per_seq"]})


# ------------------------------------------------------------------------------------ Fig. 15, parallel n = 2
def parallel_saving_causes(sp: sharing.Params, traces: tuple = ("sharegpt", "sharegpt_synthetic"),
                           widths: tuple = (2,), progress: bool = True, cost: CostModel | None = None) -> pd.DataFrame:
    """Fig. 15's parallel-sampling saving (§6.3) with and without its two candidate causes of a low value: each
    trace and width at notebook 04's Fig. 13 rate and trace size, with the samples' output lengths drawn
    independently (as ``sharing.sim_parallel_savings``) or all equal to the trace's, each averaged over steps
    weighted by duration (notebook 04's measure) and per step."""
    jobs = [(w, n, eq) for w in traces for n in widths for eq in (False, True)]
    return pd.DataFrame(pmap(partial(_saving_row, sp=sp, cost=cost or CostModel()), jobs, "saving causes",
                             progress))


def _saving_row(job: tuple, sp: sharing.Params, cost: CostModel) -> dict:
    w, n, equal = job
    like = "sharegpt" if w.startswith("sharegpt") else w
    trace = make_trace(w, sp.sim_requests[like], sp.sim_rates[like], sp.seed)
    r = simulate(trace, "paged", paper_slots(), sp.block_size, cost, n=n, seed=sp.seed, preemption_mode="swap",
                 num_cpu_blocks=sp.sim_cpu_blocks, equal_sample_lengths=equal)
    d = r._steps(True)
    return {"trace": w, "width": n, "sample_lengths": "equal" if equal else "independent",
            "saving_time_weighted_pct": 100 * r.sharing_saving(),
            "saving_step_weighted_pct": 100 * float(1 - d["physical_blocks"].sum() / d["logical_blocks"].sum()),
            "mean_batch": r.mean_batch(), "preemptions": int(sum(r.num_preemptions.values()))}


# ------------------------------------------------------------------------------------------ Fig. 15, beam
def beam_saving_vs_parents(sp: sharing.Params, width: int, parents: tuple, progress: bool = True,
                           cost: CostModel | None = None) -> pd.DataFrame:
    """Fig. 15's beam saving (§4.4, §6.3) under ``sim.BeamModel`` of ``width`` beams, for each mean number of
    distinct parents per step in ``parents``, on notebook 11's check: Alpaca at the Fig. 13 rate (time-weighted)."""
    return pd.DataFrame(pmap(partial(_beam_row, sp=sp, width=width, cost=cost or CostModel()), list(parents),
                             "beam saving vs parents", progress))


def _beam_row(m: float, sp: sharing.Params, width: int, cost: CostModel) -> dict:
    trace = make_trace("alpaca", sp.sim_requests["alpaca"], sp.sim_rates["alpaca"], sp.seed)
    r = simulate(trace, "paged", paper_slots(), sp.block_size, cost, seed=sp.seed, preemption_mode="swap",
                 num_cpu_blocks=sp.sim_cpu_blocks, beam=BeamModel(width, float(m)))
    return {"width": width, "distinct_parents": float(m), "saving_pct": 100 * r.sharing_saving()}


def parents_for_saving(table: pd.DataFrame, target_pct: float) -> float:
    """The mean distinct parents at which ``beam_saving_vs_parents``'s saving equals ``target_pct`` (linear
    interpolation between the two measured points around it; NaN if the target is outside the measured range)."""
    t = table.sort_values("saving_pct")
    s, m = t["saving_pct"].to_numpy(), t["distinct_parents"].to_numpy()
    if not s[0] <= target_pct <= s[-1]:
        return float("nan")
    return float(np.interp(target_pct, s, m))


# -------------------------------------------------------------------------------- Fig. 14b, the batch cap
def seq_cap_gains(sp: sharing.Params, widths: tuple, max_num_seqs: int, progress: bool = True,
                  cost: CostModel | None = None) -> pd.DataFrame:
    """Fig. 14's gains (§6.3) with the scheduler's cap on running sequences at ``max_num_seqs``: n = 1 (its longer
    trace) and beam search of each width in ``widths``, both systems, by notebook 11's rule (``sharing.sim_rate``,
    swap preemption, the measured beam model). One bisection per (width, system), parallel."""
    jobs = [(k, s) for k in (1, *widths) for s in ("orca_oracle", "paged")]
    got = dict(zip(jobs, pmap(partial(_cap_rate, sp=sp, cap=max_num_seqs, cost=cost or CostModel()), jobs,
                              f"gains at max_num_seqs {max_num_seqs}", progress)))
    rows = []
    for k in (1, *widths):
        paged, orca = got[(k, "paged")], got[(k, "orca_oracle")]
        rows.append({"method": "n=1" if k == 1 else "beam", "width": k, "max_num_seqs": max_num_seqs,
                     **sharing.gain_columns(paged, orca)})
    return pd.DataFrame(rows)


def _cap_rate(job: tuple, sp: sharing.Params, cap: int, cost: CostModel):
    k, system = job
    base = make_trace("alpaca", sp.gain_requests_n1 if k == 1 else sp.gain_requests, 1.0, sp.seed)
    return sharing.sim_rate(replace(sp), system, k, "swap", base, cost, BeamModel.measured(k) if k > 1 else None,
                            max_num_seqs=cap)
