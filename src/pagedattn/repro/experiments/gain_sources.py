"""Where Fig. 14's gains and Fig. 15's savings come from: measurements that explain (or fail to explain) the claims of
notebooks 04 and 11 that miss the paper (paper §6.3, Figs. 14-15; issue 30 part 5).

Small measurements, each a few replays of the paper-scale simulator (OPT-13B / A100-40GB, 15.7K slots, Alpaca
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
- ``n1_batch_split``: Fig. 14a at n = 1, the batch ratio at capacity split into memory (how many requests fit in
  the KV budget, and the slots each holds) and scheduling (the cap on running sequences, the arrivals), each factor
  from its own replays (``batch_split_factors``).
- ``seq_cap_gains``: Fig. 14's gains, n = 1 and every beam width (Fig. 14b) or parallel-sampling width (Fig. 14a),
  with the scheduler's ``max_num_seqs`` raised; ``parallel_cap_use``: how often the cap binds at the sustainable
  rates.
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import numpy as np
import pandas as pd

from pagedattn.repro.paper import paper_slots
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
    the n = 1 Alpaca trace with vLLM's preemption rule (as ``sharing.sim_rate``); one row of ``decode_terms`` each."""
    jobs = [("paged", rate_paged, "own"), ("orca_oracle", rate_orca, "own"), ("paged", rate_orca, "orca_oracle's")]
    rows = pmap(partial(_n1_row, sp=sp, cost=cost or CostModel()), jobs, "n=1 gain sources", progress)
    return pd.DataFrame(rows)


def _n1_row(job: tuple, sp: sharing.Params, cost: CostModel) -> dict:
    system, rate, which = job
    trace = with_rate(make_trace("alpaca", sp.gain_requests_n1, 1.0, sp.seed), rate, sp.seed)
    r = simulate(trace, system, paper_slots(), sp.block_size, cost, seed=sp.seed, **sharing.preemption(sp))
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


#: the runs of ``n1_batch_split``: (label, rate: "own" sustainable rate / "fig13" the paper's Fig. 13 rate / inf
#: offline, every request queued at t = 0; cap on running sequences: vLLM's default or ``LIFTED_SEQ_CAP``)
BATCH_SPLIT_RUNS = (("own rate", "own", "default"), ("Fig. 13 rate", "fig13", "default"),
                    ("offline", math.inf, "default"), ("offline, cap lifted", math.inf, "lifted"))


def batch_split_terms(r: SimResult, max_num_seqs: int, n: int = 1) -> dict:
    """What sets one replay's batch (Fig. 13's mean running requests per decode step, ``SimResult.mean_batch``):
    ``saturated_batch`` is the time-weighted mean over the decode steps that leave requests waiting or swapped out
    (the scheduler would run more if it could: memory or the cap stops it), ``slots_per_request`` the KV slots a
    running request holds on those steps (token states, reservation and internal waste: blocks per request, in
    slots), ``kv_held_pct`` the share of the KV slots running requests hold on those steps (the rest is free or a
    buddy block's rounding), ``at_cap_share`` the share of decode steps running ``max_num_seqs`` requests (n = 1
    only: the steps record requests, not the samples still running), ``waiting_share`` the share with requests
    waiting or swapped out, and the normalized latency (steady window; an offline run's is the whole run)."""
    d = r._steps(True)
    dec = d[d["kind"] == "decode"]
    held_back = (dec["num_waiting"] + dec["num_swapped"]) > 0
    sat = dec[held_back]
    held = sat["token_states"] + sat["reserved"] + sat["internal"]
    return {"batch": r.mean_batch(),
            "saturated_batch": float((sat["num_running"] * sat["dt"]).sum() / sat["dt"].sum()) if len(sat)
            else float("nan"),
            "slots_per_request": float(held.sum() / sat["num_running"].sum()) if len(sat) else float("nan"),
            "kv_held_pct": float(100 * held.sum() / (held.sum() + sat["external"].sum())) if len(sat)
            else float("nan"),
            "at_cap_share": float((dec["num_running"] >= max_num_seqs).mean()) if len(dec) and n == 1 else
            float("nan"),
            "waiting_share": float(held_back.mean()) if len(dec) else float("nan"),
            "memory_bound_share": r.memory_bound_share(), "preemptions": int(sum(r.num_preemptions.values())),
            "normalized_latency_s": r.load().normalized_latency_s}


def n1_batch_split(sp: sharing.Params, rate_paged: float, rate_orca: float, cost: CostModel | None = None,
                   progress: bool = True) -> pd.DataFrame:
    """Fig. 14a at n = 1 (§6.3): the replays that split the batch ratio at capacity (ours over Orca (Oracle), each
    at its own sustainable rate) into memory and scheduling, one row of ``batch_split_terms`` per (system, run of
    ``BATCH_SPLIT_RUNS``) on the n = 1 Alpaca trace with vLLM's preemption rule (as ``sharing.sim_rate``): each system at
    its own sustainable rate, at the paper's Fig. 13 rate (where the paper's batches are), offline with the
    scheduler's cap on running sequences (vLLM's 256), and offline with the cap lifted. Factors:
    ``batch_split_factors``."""
    from pagedattn.config import SchedulerConfig

    own = {"paged": rate_paged, "orca_oracle": rate_orca}
    caps = {"default": SchedulerConfig.max_num_seqs, "lifted": LIFTED_SEQ_CAP}
    jobs = [(s, label, own[s] if rate == "own" else sp.sim_rates["alpaca"] if rate == "fig13" else rate, caps[cap], 1)
            for s in ("paged", "orca_oracle") for label, rate, cap in BATCH_SPLIT_RUNS]
    return pd.DataFrame(pmap(partial(_split_row, sp=sp, cost=cost or CostModel()), jobs, "n=1 batch split",
                             progress))


def _split_row(job: tuple, sp: sharing.Params, cost: CostModel) -> dict:
    """One replay of ``n1_batch_split`` or ``parallel_cap_use``: ``(system, run label, rate, max_num_seqs, n)`` on
    the Alpaca trace of Fig. 14's searches (``sharing.sim_rate``'s trace, vLLM's preemption rule)."""
    system, label, rate, cap, n = job
    trace = with_rate(make_trace("alpaca", sp.gain_requests_n1 if n == 1 else sp.gain_requests, 1.0, sp.seed), rate,
                      sp.seed)
    r = simulate(trace, system, paper_slots(), sp.block_size, cost, n=n, seed=sp.seed, max_num_seqs=cap,
                 **sharing.preemption(sp))
    return {"system": system, "run": label, "width": n, "rate": rate, "max_num_seqs": cap,
            **batch_split_terms(r, cap, n)}


def parallel_cap_use(sp: sharing.Params, gain: pd.DataFrame, progress: bool = True,
                     cost: CostModel | None = None) -> pd.DataFrame:
    """Fig. 14a (§6.3): does the scheduler's cap on running sequences bind where parallel sampling's gain is
    measured? Both systems replayed at their sustainable rates of each row of ``gain`` (``sharing.sim_parallel_gain``'s
    headline rows) with vLLM's cap and with ``LIFTED_SEQ_CAP``, one row of ``batch_split_terms`` each: where
    the two replays agree the cap does not bind at that rate; ``memory_bound_share`` and ``waiting_share`` tell
    whether memory does."""
    from pagedattn.config import SchedulerConfig

    g = gain[gain.preemption == sharing.HEADLINE_RULE]
    jobs = [(s, "own rate", float(getattr(r, f"rate_{s}")), cap, int(r.width)) for r in g.itertuples()
            for s in ("paged", "orca_oracle") for cap in (SchedulerConfig.max_num_seqs, LIFTED_SEQ_CAP)]
    return pd.DataFrame(pmap(partial(_split_row, sp=sp, cost=cost or CostModel()), jobs, "parallel cap use",
                             progress))


def batch_split_factors(split: pd.DataFrame) -> pd.Series:
    """Ours over Orca (Oracle) from ``n1_batch_split``'s runs. The batch ratio at capacity (each system at its own
    sustainable rate) is the product of three ratios, each measured by its own runs: **memory**, how many requests
    fit in the KV budget (the saturated batch offline with the cap lifted), with its two parts beside it: the KV
    slots a running request holds (Orca / ours: blocks per request) and the share of the KV slots held at all;
    **the cap**, the share of that the scheduler's ``max_num_seqs`` lets run (saturated batch offline at the cap /
    with it lifted); **arrivals**, the share of the capped offline batch that the arrival process keeps running at the sustainable rate (batch at the own rate /
    saturated batch offline). Also the batch ratio at the Fig. 13 rate, where the paper's is."""
    t = split.set_index(["system", "run"])

    def ratio(col: str, run: str, inverse: bool = False) -> float:
        p, o = float(t.loc[("paged", run), col]), float(t.loc[("orca_oracle", run), col])
        return o / p if inverse else p / o

    def share(system: str, num: tuple, den: tuple) -> float:
        return float(t.loc[(system, num[0]), num[1]]) / float(t.loc[(system, den[0]), den[1]])

    cap = ("offline", "saturated_batch"), ("offline, cap lifted", "saturated_batch")
    arrivals = ("own rate", "batch"), ("offline", "saturated_batch")
    return pd.Series({
        "batch ratio at capacity": ratio("batch", "own rate"),
        "memory: requests that fit (offline, cap lifted)": ratio("saturated_batch", "offline, cap lifted"),
        "memory: KV slots per running request (Orca / ours)": ratio("slots_per_request", "offline, cap lifted",
                                                                    inverse=True),
        "memory: share of KV slots held": ratio("kv_held_pct", "offline, cap lifted"),
        "cap: offline batch at the cap / lifted": share("paged", *cap) / share("orca_oracle", *cap),
        "arrivals: batch at capacity / offline at the cap": share("paged", *arrivals) / share("orca_oracle",
                                                                                               *arrivals),
        "batch ratio at the Fig. 13 rate": ratio("batch", "Fig. 13 rate")})


def batch_split_note(factors: pd.Series, fig13_rate: float, paper_ratio: float) -> str:
    """A claim note's sentence from ``batch_split_factors``: the n = 1 batch ratio at capacity in its three factors,
    and the ratio at the Fig. 13 rate against the paper's (``paper_ratio``, its Fig. 13 batches)."""
    f = factors
    if not np.isfinite(f.to_numpy(dtype=float)).all():
        return ("batch ratio at capacity not split: the trace does not fill the KV budget offline "
                "(gain_sources.n1_batch_split)")
    return (f"batch ratio at capacity {f['batch ratio at capacity']:.2f}x = memory "
            f"{f['memory: requests that fit (offline, cap lifted)']:.2f}x (KV slots per request "
            f"{f['memory: KV slots per running request (Orca / ours)']:.2f}x, share of KV slots held "
            f"{f['memory: share of KV slots held']:.2f}x) x cap {f['cap: offline batch at the cap / lifted']:.2f} x "
            f"arrivals {f['arrivals: batch at capacity / offline at the cap']:.2f}; at the Fig. 13 rate "
            f"({fig13_rate:g} req/s) {f['batch ratio at the Fig. 13 rate']:.2f}x against the paper's "
            f"{paper_ratio:.2f}x (gain_sources.n1_batch_split)")


def falls_at_widest(gains: pd.Series) -> bool:
    """Whether gains by width (a series indexed by width) fall from the second-largest width to the largest."""
    g = gains.sort_index()
    return len(g) > 1 and float(g.iloc[-1]) < float(g.iloc[-2])


def seq_cap_verdict(cap_gains: pd.DataFrame, at_default: pd.Series) -> str:
    """Whether vLLM's ``max_num_seqs`` explains a fall of the gain at the largest width (:func:`seq_cap_note`)."""
    lifted = cap_gains.set_index("width")["gain"]
    method = "beam width" if (cap_gains.method == "beam").any() else "n"
    wmax = int(lifted.index.max())
    if not falls_at_widest(at_default):
        return f"the gain does not fall at {method} = {wmax} at vLLM's cap"
    if falls_at_widest(lifted):
        return f"the cap does not explain the fall at {method} = {wmax}"
    return f"the cap explains the fall at {method} = {wmax}"


def seq_cap_note(cap_gains: pd.DataFrame, at_default: pd.Series) -> str:
    """A claim note's sentence from ``seq_cap_gains(..., LIFTED_SEQ_CAP)``: the gains with the cap lifted, and
    whether the cap explains a fall of the gain at the largest width (``at_default``: the claims' gains by width, at
    vLLM's cap): it does if the gain falls there at the default cap and not with it lifted."""
    lifted = cap_gains.set_index("width")["gain"]
    method = "beam width" if (cap_gains.method == "beam").any() else "n"
    verdict = seq_cap_verdict(cap_gains, at_default)
    return (f"with max_num_seqs {int(cap_gains.max_num_seqs.iloc[0])} the gains are "
            + " / ".join(f"{v:.2f}" for v in lifted.sort_index()) + f"x ({method} = "
            + ", ".join(str(int(w)) for w in sorted(lifted.index)) + f"; gain_sources.seq_cap_gains): {verdict}")


def memory_bound_note(use: pd.DataFrame) -> str:
    """A claim note's sentence from ``parallel_cap_use``: at vLLM's cap, the share of steps each system is
    memory-bound at its sustainable rate, at the largest width."""
    from pagedattn.config import SchedulerConfig

    u = use[use.max_num_seqs == SchedulerConfig.max_num_seqs]
    w = int(u.width.max())
    mb = u[u.width == w].set_index("system")["memory_bound_share"]
    return (f"at n = {w} ours is memory-bound in {float(mb['paged']):.0%} of steps at its sustainable rate, "
            f"Orca (Oracle) in {float(mb['orca_oracle']):.0%} (gain_sources.parallel_cap_use)")


def sample_length_stretch(sp: sharing.Params, widths: tuple) -> pd.DataFrame:
    """How much the per-sample output lengths stretch a parallel-sampling request (§6.3): a group ends with its
    longest sample, and normalized latency divides its latency by the trace's output length (the first sample's),
    so with n independent lengths the unloaded normalized latency grows by ``max / first``. Mean and median of that
    ratio over Fig. 14's n > 1 trace, with the lengths drawn as ``sim.simulate(n=n)`` draws them
    (``sharing.sample_lengths``)."""
    trace = make_trace("alpaca", sp.gain_requests, 1.0, sp.seed)
    rows = []
    for n in widths:
        r = np.array([max(lens) / lens[0] for lens in sharing.sample_lengths(trace, n, sp.seed, sp.max_model_len)])
        rows.append({"width": n, "mean_stretch": float(r.mean()), "median_stretch": float(np.median(r))})
    return pd.DataFrame(rows)


def rise_over_n1(gains: pd.Series) -> float:
    """The largest gain at n > 1 over the gain at n = 1, minus one (gains indexed by width, n = 1 included)."""
    return float(gains[gains.index > 1].max() / gains[1] - 1)


def equal_lengths_note(equal: pd.DataFrame, at_default: pd.Series) -> str:
    """A claim note's sentence from ``seq_cap_gains(..., equal_sample_lengths=True)``: parallel sampling's gains
    with every sample as long as the trace's output, and how far they rise over n = 1 against the claims' gains
    (``at_default``, independent per-sample lengths); "most of the rise" when less than half of it is left."""
    eq = equal.set_index("width")["gain"].sort_index()
    r_eq, r_def = rise_over_n1(eq), rise_over_n1(at_default)
    return ("with every sample the trace's output length the gains are " + " / ".join(f"{v:.2f}" for v in eq)
            + f"x, at most {r_eq:+.0%} over n = 1 against {r_def:+.0%} with independent lengths "
            f"(gain_sources.seq_cap_gains(equal_sample_lengths=True))"
            + (": most of the rise with n comes with the independent per-sample lengths" if r_eq < r_def / 2 else ""))


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
    r = simulate(trace, "paged", paper_slots(), sp.block_size, cost, n=n, seed=sp.seed, equal_sample_lengths=equal,
                 **sharing.preemption(sp))
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
    r = simulate(trace, "paged", paper_slots(), sp.block_size, cost, seed=sp.seed, beam=BeamModel(width, float(m)),
                 **sharing.preemption(sp))
    return {"width": width, "distinct_parents": float(m), "saving_pct": 100 * r.sharing_saving()}


def parents_for_saving(table: pd.DataFrame, target_pct: float) -> float:
    """The mean distinct parents at which ``beam_saving_vs_parents``'s saving equals ``target_pct`` (linear
    interpolation between the two measured points around it; NaN if the target is outside the measured range)."""
    t = table.sort_values("saving_pct")
    s, m = t["saving_pct"].to_numpy(), t["distinct_parents"].to_numpy()
    if not s[0] <= target_pct <= s[-1]:
        return float("nan")
    return float(np.interp(target_pct, s, m))


# ------------------------------------------------------------------------------ Fig. 14a and 14b, the batch cap
def seq_cap_gains(sp: sharing.Params, widths: tuple, max_num_seqs: int, progress: bool = True,
                  cost: CostModel | None = None, method: str = "beam",
                  equal_sample_lengths: bool = False) -> pd.DataFrame:
    """Fig. 14's gains (§6.3) with the scheduler's cap on running sequences at ``max_num_seqs``: n = 1 (its longer
    trace) and each width in ``widths`` of ``method``, ``"beam"`` (beam search, the measured beam model; Fig. 14b) or
    ``"parallel"`` (parallel sampling of n samples; Fig. 14a), both systems, by notebook 11's rule
    (``sharing.sim_rate``, vLLM's preemption rule). The cap counts sequences, so n samples or beams take n of its places.
    ``equal_sample_lengths``: every parallel sample as long as the trace's output (``sim.simulate``'s ablation of the
    independent per-sample lengths) instead of drawn. One bisection per (width, system), parallel."""
    if method not in ("beam", "parallel"):
        raise ValueError(f"method must be 'beam' or 'parallel', got {method!r}")
    jobs = [(k, s) for k in (1, *widths) for s in ("orca_oracle", "paged")]
    rate = partial(_cap_rate, sp=sp, cap=max_num_seqs, cost=cost or CostModel(), method=method,
                   equal_sample_lengths=equal_sample_lengths)
    got = dict(zip(jobs, pmap(rate, jobs, f"{method} gains at max_num_seqs {max_num_seqs}", progress)))
    rows = []
    for k in (1, *widths):
        paged, orca = got[(k, "paged")], got[(k, "orca_oracle")]
        rows.append({"method": "n=1" if k == 1 else method, "width": k, "max_num_seqs": max_num_seqs,
                     "equal_sample_lengths": equal_sample_lengths, **sharing.gain_columns(paged, orca)})
    return pd.DataFrame(rows)


def _cap_rate(job: tuple, sp: sharing.Params, cap: int, cost: CostModel, method: str = "beam",
              equal_sample_lengths: bool = False):
    k, system = job
    base = make_trace("alpaca", sp.gain_requests_n1 if k == 1 else sp.gain_requests, 1.0, sp.seed)
    beam = BeamModel.measured(k) if k > 1 and method == "beam" else None
    return sharing.sim_rate(replace(sp), system, k, base, cost, beam, max_num_seqs=cap,
                            equal_sample_lengths=equal_sample_lengths)
