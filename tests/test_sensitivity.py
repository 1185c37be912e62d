"""Sensitivity bands (pagedattn.repro.experiments.sensitivity), the simulator's swap charge and its steady-state window (issue 13)."""
from __future__ import annotations

import math
from dataclasses import replace

import pandas as pd
import pytest

from pagedattn.repro.experiments import sensitivity as S
from pagedattn.repro.report.results import Claim
from pagedattn.repro.sim.simulator import CostModel, SimResult, simulate
from pagedattn.repro.workloads.traces import TraceRequest, make_trace


def test_grid_is_the_stated_one():
    full = S.points()
    assert full[0] == S.DEFAULT and len(set(full)) == len(full) == 1 + 5 + 5 + 2 + 1  # 4 extremes + TRANSFER at 2 rates
    assert full[-1] == S.ASSUMED
    (b0, b1), (f0, f1) = S.MEASURED_BAND["bandwidth_efficiency"], S.MEASURED_BAND["flops_efficiency"]
    (o0, o1), (s0, s1) = S.MEASURED_BAND["step_overhead_s"], S.MEASURED_BAND["step_overhead_per_seq_s"]
    d = S.DEFAULT
    steps = {(p.bandwidth_efficiency, p.flops_efficiency, p.step_overhead_s, p.step_overhead_per_seq_s) for p in full}
    assert steps == {(d.bandwidth_efficiency, d.flops_efficiency, d.step_overhead_s, d.step_overhead_per_seq_s),
                     (b1, f1, o0, s0), (b0, f0, o1, s1), (b1, f0, d.step_overhead_s, d.step_overhead_per_seq_s),
                     (b0, f1, d.step_overhead_s, d.step_overhead_per_seq_s), (0.7, 0.5, 0.004, 0.0),
                     (0.85, d.flops_efficiency, d.step_overhead_s, d.step_overhead_per_seq_s)}
    assert S.TRANSFER.bandwidth_efficiency == round(d.bandwidth_efficiency * 2.039 / 1.555, 2)  # absolute bytes/s
    assert {p.rate for p in full} == {"experiment", "equal_load"}
    assert len(S.points(rate_axis=False, trace_axis=False, assumed=False)) == 6  # 4 extremes + TRANSFER
    corners = S.points(rate_axis=False, trace_axis=False, extremes=False, assumed=False)[1:-1]
    assert {(p.bandwidth_efficiency, p.flops_efficiency, p.step_overhead_s) for p in corners} == \
        {(b, f, o) for b in (b0, b1) for f in (f0, f1) for o in (o0, o1)}
    assert S.points(quick=True) == [S.DEFAULT, replace(S.DEFAULT, bandwidth_efficiency=b1, flops_efficiency=f1,
                                                       step_overhead_s=o0, step_overhead_per_seq_s=s0)]
    extra = S.points(rate_axis=False, trace_axis=False, rate_scales=(0.5,), copy_latencies=(1e-5,))
    assert replace(d, rate_scale=0.5) in extra and replace(d, copy_latency_s=1e-5) in extra
    text = S.describe(full)
    assert "equal-load" in text and f"({b1:.3g}, {f0:.3g}," in text and "reported apart" in text
    assert "0.7, 0.5, 4 ms" in text and "(0.7, 0.5, 4 +" not in text  # the assumed point is not a band corner


def test_point_sets_the_cost_model_and_trace():
    p = S.Point(0.5, 0.3, 0.0, trace="other", copy_latency_s=1e-6)
    c = p.cost(CostModel(kernel_overhead=2.0))
    assert (c.bandwidth_efficiency, c.flops_efficiency, c.step_overhead_s, c.copy_latency_s, c.kernel_overhead) == \
        (0.5, 0.3, 0.0, 1e-6, 2.0)
    assert p.trace_name("sharegpt") == "sharegpt_synthetic" and p.trace_name("alpaca") == "alpaca"
    assert S.DEFAULT.trace_name("sharegpt") == "sharegpt"


def test_equal_load_rate_scales_with_capacity(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDATTN_SENSITIVITY_CACHE", str(tmp_path))
    fast = S.Point(0.9, 0.7, 0.0, rate="equal_load")
    assert S.rate_at(S.Point(0.9, 0.7, 0.0), "alpaca", 30.0, 60) == 30.0  # the experiment's rate: untouched
    assert S.rate_at(replace(S.DEFAULT, rate="equal_load"), "alpaca", 30.0, 60) == pytest.approx(30.0)
    here = S.capacity("alpaca", 60, 0, fast.cost())
    there = S.capacity("alpaca", 60, 0, CostModel())
    assert here > there  # a faster step serves more
    assert S.rate_at(fast, "alpaca", 30.0, 60) == pytest.approx(30.0 * here / there)


def test_cache_returns_the_stored_value(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDATTN_SENSITIVITY_CACHE", str(tmp_path))
    calls = []
    assert S.cached({"k": 1}, lambda: calls.append(1) or [1, 2]) == [1, 2]
    assert len(list(tmp_path.glob("*.json"))) == 1  # stored where the environment says
    assert S.cached({"k": 1}, lambda: calls.append(1) or [3]) == [1, 2]
    assert S.cached({"k": 2}, lambda: calls.append(1) or [3]) == [3]
    assert len(calls) == 2


def _table(rows):
    return pd.DataFrame([{"point": f"p{i}", "is_default": i == 0, "claim": n, "ours": v, "holds": h}
                         for i, (n, v, h) in enumerate(rows)])


def test_band_holds_only_where_every_point_holds():
    claims = [Claim("a", 1.0, 1.1, holds=True), Claim("b", [16, 32], [1, 16, 32], holds=True),
              Claim("c", 1.0, 3.0, holds=True, kind="invariant"), Claim("d", 1.0, 1.0, holds=True)]
    table = _table([("a", 1.1, True), ("a", 0.7, False), ("a", 1.2, True),
                    ("b", [1, 16, 32], True), ("b", [16, 32, 64], True),
                    ("c", 3.0, True), ("c", 4.0, True), ("d", 1.0, True)])
    a, b, c, d = S.with_bands(claims, table, "grid")
    assert a.band == {"min": 0.7, "max": 1.2, "over": "grid", "outside": 1, "points": 3} and a.holds is False
    assert "fails at 1 of 3" in a.note
    assert b.band["min"] == [16, 32] and b.band["max"] == [1, 16, 32, 64] and b.holds is True
    assert c.band is None  # an invariant gets no band
    assert d.band is None  # only the default point: not swept
    assert S.breaks(table).set_index("claim").loc["a", "fails_at"] == 1


def test_ratio_tolerance_is_two_sided():
    assert S.widened(1.7, 2.7) == pytest.approx((1.275, 3.375))
    assert S.widened(1.3) == pytest.approx((0.975, 1.625))


def test_simulator_charges_swaps():
    """A swap-preempting run is slower when a copy costs more; with recomputation it does not care."""
    trace = [TraceRequest(f"r{i}", 0.0, 200, 300) for i in range(12)]
    slots = 6 * 16 * 40  # room for a few requests only: preemption is certain

    def duration(mode, latency):
        r = simulate(trace, "paged", slots, 16, CostModel(copy_latency_s=latency), preemption_mode=mode,
                     num_cpu_blocks=4000 if mode == "swap" else 0)
        return r.duration, sum(r.num_preemptions.values())

    (cheap, n), (dear, _) = duration("swap", 0.0), duration("swap", 1e-3)
    assert n > 0 and dear > cheap
    assert duration("recompute", 0.0)[0] == duration("recompute", 1e-3)[0]


def test_steady_window_leaves_out_ramp_up_and_drain():
    reqs = pd.DataFrame({"arrival_time": [float(i) for i in range(10)], "finish_time": [20.0] * 10,
                         "output_len": [1] * 10})
    steps = pd.DataFrame({"time": [0.0, 1.0, 2.5, 5.0, 9.5, 15.0], "dt": [1.0] * 6,
                          "kind": ["decode"] * 6, "num_running": [1, 2, 50, 50, 3, 1], "memory_bound": [False] * 6})
    r = SimResult("paged", steps, reqs)
    assert r.steady_window() == (2.0, 9.0)  # the arrival at a fifth of the trace, the last arrival
    assert r.mean_batch() == 50 and r.mean_batch(steady=False) == pytest.approx(107 / 6)
    offline = SimResult("paged", steps, reqs.assign(arrival_time=0.0))
    assert offline.steady_window() == (0.0, math.inf)


def test_steady_batch_does_not_depend_on_trace_length():
    """The Fig. 13 statistic of one model at one rate: a trace twice as long gives about the same batch (as long as
    a fifth of the arrivals outlasts the ramp-up: here 1000 Alpaca requests at 30 req/s, 6.7 s against a request
    lifetime of about 5 s), while the average over all steps moves with the trace's length."""
    short, long_ = (simulate(make_trace("alpaca", n, 30.0, 0), "paged") for n in (1000, 2000))
    assert short.mean_batch() == pytest.approx(long_.mean_batch(), rel=0.1)
    assert abs(short.mean_batch(steady=False) / long_.mean_batch(steady=False) - 1) > \
        abs(short.mean_batch() / long_.mean_batch() - 1)


def test_every_band_on_the_a100_profile_has_the_transfer_corner(monkeypatch):
    """Issue 61: the 80 -> 40 GB card transfer's corner is in every band built on the A100 profile: the shortened
    grid of a search over rates (notebooks 10 and 11) has it after its three step-time points, except for a setup on
    the profile's own card (OPT-175B on A100-80GB) and in quick mode."""
    from pagedattn.repro.experiments import fig14_curves, scale

    fastest, slowest = S.points(rate_axis=False, trace_axis=False)[1:3]
    assert S.step_extremes() == [S.DEFAULT, fastest, slowest, S.TRANSFER]
    assert S.step_extremes(transfer=False) == [S.DEFAULT, fastest, slowest]
    assert S.step_extremes(quick=True) == S.points(quick=True)
    grids = {}

    def sweep(name, fn, pts, *args, **kw):
        grids[name] = pts
        return pd.DataFrame()
    monkeypatch.setattr(S, "sweep", sweep)
    # the cache off: notebook 11's band otherwise runs its points' searches first (``fig14_curves.band_searches``),
    # the whole full-size band (6.5 minutes of the suite on a 2-core VM), before the sweep this test records
    monkeypatch.setenv(S.CACHE_ENV, "0")
    monkeypatch.setattr(S, "with_bands", lambda default, t, over: default)
    scale.bands(scale.Params.make(False), [])
    assert S.TRANSFER in grids["10_table1_fig12.OPT-66B"] and S.TRANSFER not in grids["10_table1_fig12.OPT-175B"]
    assert "10_table1_fig12.OPT-13B" not in grids  # notebook 03's claims: their band is 03's
    fig14_curves.beam_bands(fig14_curves.sharing_params(False), fig14_curves.Params.make(False), [])
    assert S.TRANSFER in grids["11_fig14_curves.beam"]


def test_claims_on_assumed_constants_say_so_in_their_reason():
    """Issue 61: a claim whose value rests on an assumed constant names it, with its value, in its reason: Fig. 14's
    swapping gains (04, 11), Fig. 19's modelled ratio (06), the tensor-parallel rate ratios and Table 1's KV at the
    assumed memory utilisation (10); a claim that does not rest on one keeps its reason."""
    from pagedattn.repro.experiments import fig14_curves, scale, sharing
    from pagedattn.repro.sim.simulator import assumed_reason

    swap = assumed_reason("swap")
    assert "32 GB/s x 0.8" in swap and "5 us per copy" in swap and "150 GB/s" in assumed_reason("nvlink")
    claims = [Claim(n, 1.3, 1.5, "x", "", True, "note", accept=[1.0, 2.0], reason=r) for n, r in
              (("gain_at_fixed_latency.n1", ""), ("gain_at_fixed_latency.n1.forced_swap", ""),
               ("gain_grows_with_width.beam", "grows x1.1"), ("beam_model.saving_pct.alpaca.beam_w6", ""),
               ("beam_model.saving_pct.alpaca.beam_w2", ""))]
    beam_savings = pd.DataFrame({"width": [2, 6], "swaps": [0, 3]})
    got = {c.name: c.reason for c in S.rests_on(claims, lambda n: fig14_curves.swap_priced(beam_savings, n), swap)}
    assert got["gain_at_fixed_latency.n1"] == ""  # n = 1 under vLLM's rule never swaps
    assert got["gain_at_fixed_latency.n1.forced_swap"].endswith(swap) and got["gain_at_fixed_latency.n1.forced_swap"]
    assert got["gain_grows_with_width.beam"] == f"grows x1.1; {swap}"
    assert got["beam_model.saving_pct.alpaca.beam_w6"].endswith(swap)
    assert got["beam_model.saving_pct.alpaca.beam_w2"] == ""
    savings = pd.DataFrame({"trace": ["alpaca", "sharegpt_synthetic", "sharegpt"], "method": "parallel",
                            "width": [2, 4, 4], "swaps": [1, 2, 0]})
    assert sharing.swap_priced(savings, "saving_pct.alpaca.parallel_n2")
    assert sharing.swap_priced(savings, "saving_pct.sharegpt.parallel_n4.synthetic")
    assert not sharing.swap_priced(savings, "saving_pct.sharegpt.parallel_n4")
    assert sharing.swap_priced(savings, "gain_over_orca_oracle.n1.forced_swap")
    assert not sharing.swap_priced(savings, "gain_over_orca_oracle.n1")
    t10 = [Claim(n, 1.0, 1.0, "x") for n in ("rate_ratio.OPT-13B.sharegpt.paged_vs_orca_max",
                                             "rate_ratio.OPT-66B.sharegpt.paged_vs_orca_max",
                                             "table1.kv_gb_at_utilisation.OPT-13B")]
    got = {c.name: c.reason for c in scale.assumptions_in_reasons(t10)}
    assert got["rate_ratio.OPT-13B.sharegpt.paged_vs_orca_max"] == ""  # one GPU: no all-reduce
    assert got["rate_ratio.OPT-66B.sharegpt.paged_vs_orca_max"].endswith(assumed_reason("nvlink"))
    assert "memory utilisation of 0.9" in got["table1.kv_gb_at_utilisation.OPT-13B"]
