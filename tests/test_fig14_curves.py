"""Notebook 11's claims (``experiments.fig14_curves``): Fig. 14's gains at a fixed latency, their growth with n and
with the beam width, and the beam model's saving against Fig. 15."""
import pandas as pd
import pytest


def test_fig14_gain_claims():
    from pagedattn.repro.experiments import fig14_curves

    def gains(values, beams=None):
        rows = [{"method": "parallel", "width": n, "preemption": "vllm", "gain": g} for n, g in values.items()]
        rows += [{"method": "beam", "width": k, "preemption": "vllm", "gain": g} for k, g in (beams or {}).items()]
        return pd.DataFrame(rows)

    got = {c.name: c for c in fig14_curves.claims(gains({1: 1.2, 2: 1.5, 4: 1.4, 6: 2.0}))}
    assert got["gain_at_fixed_latency.n1"].holds is True
    assert got["gain_grows_with_n.parallel"].holds is False  # 1.5 -> 1.4 falls
    assert got["gain_at_fixed_latency.beam_w6"].ours is None and "gain_grows_with_width.beam" not in got
    got = {c.name: c for c in fig14_curves.claims(gains({1: 2.0, 6: 3.0}))}
    assert got["gain_at_fixed_latency.n1"].holds is False and got["gain_grows_with_n.parallel"].holds is True
    # beam width 6 within 2.3x +- 25 % (1.725-2.875); the growth from n = 1 to beam width 6 within the paper's
    # 2.3 / 1.3 = 1.77x +- 25 % (1.33-2.21x), two-sided
    got = {c.name: c for c in fig14_curves.claims(gains({1: 1.3}, {2: 1.5, 4: 1.9, 6: 2.8}))}
    assert got["gain_at_fixed_latency.beam_w6"].holds is True and got["gain_grows_with_width.beam"].holds is True
    grow = got["gain_grows_with_width.beam"]
    assert grow.paper == 1.769 and grow.ours == round(2.8 / 1.3, 3) and grow.accept == pytest.approx([1.327, 2.212],
                                                                                                   abs=1e-3)
    assert grow.strict == pytest.approx([2.25 / 1.35, 2.35 / 1.25]) and "1.300, 1.500, 1.900, 2.800" in grow.note
    assert got["gain_at_fixed_latency.beam_w2"].kind == "tracking"
    got = {c.name: c for c in fig14_curves.claims(gains({1: 1.3}, {2: 1.5, 4: 1.4, 6: 2.9}))}
    assert got["gain_at_fixed_latency.beam_w6"].holds is False and got["gain_grows_with_width.beam"].holds is False
    # a gain that rises, but by less than the paper's (1.71 -> 1.90: x1.11), fails; so does one that rises too much
    for n1, w6 in ((1.714, 1.896), (1.0, 2.3)):
        got = {c.name: c for c in fig14_curves.claims(gains({1: n1}, {2: n1, 4: w6, 6: w6}))}
        assert got["gain_grows_with_width.beam"].holds is False, (n1, w6)
    savings = pd.DataFrame([{"width": 6, "rate": 30.0, "distinct_parents": 4.52, "saving_pct": 60.2,
                             "paper_saving_pct": 55.16}])
    got = {c.name: c for c in fig14_curves.claims(gains({1: 1.3}), savings)}
    c = got["beam_model.saving_pct.alpaca.beam_w6"]  # 5.04 points off, but not separate evidence (issue 51)
    assert c.kind == "tracking" and c.holds is None and "outside 5 points" in c.note


def test_open_failures_go_into_the_claim_notes():
    from pagedattn.repro.experiments import fig14_curves

    gain = pd.DataFrame([{"method": "n=1", "width": 1, "preemption": "vllm", "gain": 1.7},
                         {"method": "parallel", "width": 4, "preemption": "vllm", "gain": 2.2},
                         {"method": "parallel", "width": 6, "preemption": "vllm", "gain": 2.0}])
    cap = pd.DataFrame({"method": ["n=1", "parallel", "parallel"], "width": [1, 4, 6], "max_num_seqs": 2048,
                        "gain": [1.7, 2.2, 1.9]})
    use = pd.DataFrame({"system": ["paged", "orca_oracle"], "width": 6, "max_num_seqs": 256,
                        "memory_bound_share": [0.02, 0.8]})
    split = pd.DataFrame([{"system": s, "run": r, "batch": b, "saturated_batch": b, "slots_per_request": 100 / b,
                           "kv_held_pct": 90.0}
                          for s, k in (("paged", 2.0), ("orca_oracle", 1.0))
                          for r, b in (("own rate", 10 * k), ("Fig. 13 rate", 8 * k), ("offline", 11 * k),
                                       ("offline, cap lifted", 12 * k))])
    equal = cap.assign(max_num_seqs=256, gain=[1.7, 1.72, 1.71])
    got = {c.name: c for c in fig14_curves.claims(gain, None, {"parallel_seq_cap": cap, "parallel_cap_use": use,
                                                               "n1_batch_split": split,
                                                               "parallel_equal_lengths": equal})}
    assert "the cap does not explain the fall at n = 6" in got["gain_grows_with_n.parallel"].note
    assert "memory-bound in 2% of steps" in got["gain_grows_with_n.parallel"].note
    assert "most of the rise with n comes with the independent" in got["gain_grows_with_n.parallel"].note
    assert "batch ratio at capacity 2.00x = memory 2.00x" in got["gain_at_fixed_latency.n1"].note
    assert got["gain_grows_with_n.parallel"].holds is False  # the notes do not move a claim


def test_forced_swap_is_a_tracking_row_beside_the_headline():
    """Issue 61: the n = 1 claims are judged under vLLM's rule; the run with every group forced to swap is recorded
    beside them (04 and 11), never judged, and its note says it is not the paper's rule."""
    from pagedattn.repro.experiments import fig14_curves, sharing

    gain = pd.DataFrame([{"method": "n=1", "width": 1, "preemption": "vllm", "gain": 1.48},
                         {"method": "n=1", "width": 1, "preemption": "forced_swap", "gain": 1.71}])
    got = {c.name: c for c in fig14_curves.claims(gain)}
    assert got["gain_at_fixed_latency.n1"].ours == 1.48 and got["gain_at_fixed_latency.n1"].holds is True
    forced = got["gain_at_fixed_latency.n1.forced_swap"]
    assert forced.ours == 1.71 and forced.kind == "tracking" and "not the paper's rule" in forced.note
    assert "not the paper's rule" in forced.reason
    from pagedattn.repro.sim.capacity import RateSearch

    def search(rate):
        return RateSearch(rate, 1.02 * rate, 0.02, "capacity", rate, 0.1, 8, offline_rate=2 * rate, trend_se=0.0)
    rows = pd.DataFrame([{"width": 1, "preemption": rule, **sharing.gain_columns(search(ours), search(1.0))}
                         for rule, ours in (("vllm", 1.48), ("forced_swap", 1.71))])
    empty = pd.DataFrame(columns=["trace", "method", "width", "saving_pct"])
    got = {c.name: c for c in sharing.claims(empty, rows, None)}
    assert got["gain_over_orca_oracle.n1"].ours == 1.48 and got["gain_over_orca_oracle.n1"].kind == "reproduction"
    assert got["gain_over_orca_oracle.n1.forced_swap"].ours == 1.71
    assert got["gain_over_orca_oracle.n1.forced_swap"].kind == "tracking"


def test_the_band_runs_its_points_searches_first_and_its_points_then_search_nothing(monkeypatch, tmp_path):
    """``band_searches`` (issue 64: the band's points as five tasks ended on one core): every search of the band's
    points but the default's, one task each, the n = 1 searches first; with them in the search cache, the points
    themselves (``beam_claims_at``) run no search, so only the order of the work changed."""
    from pagedattn.repro.experiments import fig14_curves as f14, sensitivity, sharing

    monkeypatch.setenv("PAGEDATTN_SENSITIVITY_CACHE", str(tmp_path))
    monkeypatch.setenv(sensitivity.CACHE_ENV, "1")
    params, sp = f14.Params.make(True), f14.sharing_params(True)
    x = params.beam_parents_shift
    pts = sensitivity.step_extremes(True) + [sensitivity.Point(beam_parents_shift=-x),
                                             sensitivity.Point(beam_parents_shift=x)]
    widths = params.beam_widths
    jobs = f14.band_searches(pts, widths)
    others = [p for p in pts if not p.is_default]
    assert len(jobs) == (4 + len(widths)) * len(others) and all(not p.is_default for _, _, p in jobs)
    assert [kind for kind, _, _ in jobs] == (["n1"] * (2 * len(others)) + ["beam"] * (2 * len(others))
                                             + ["saving"] * (len(widths) * len(others)))
    for job in jobs:
        f14.band_search(job, sp)
    searched, replayed = [], []
    real, real_simulate = sharing.length_agreed_search, f14.simulate
    monkeypatch.setattr(sharing, "length_agreed_search", lambda *a, **k: searched.append(a) or real(*a, **k))
    monkeypatch.setattr(f14, "simulate", lambda *a, **k: replayed.append(a) or real_simulate(*a, **k))
    for p in others:
        assert f14.beam_claims_at(p, sp, params)
    assert searched == [] and replayed == []


def test_a_beam_saving_row_is_the_same_computed_or_read_from_the_cache(monkeypatch, tmp_path):
    """``_beam_saving_row`` stores its replay in the search cache: the row read back equals the row computed, and
    equals the row computed with the cache off, value for value."""
    from pagedattn.repro.experiments import fig14_curves as f14, sensitivity

    monkeypatch.setenv("PAGEDATTN_SENSITIVITY_CACHE", str(tmp_path))
    sp = f14.sharing_params(True)
    trace = f14._saving_trace(sp)[:60]
    monkeypatch.setenv(sensitivity.CACHE_ENV, "0")
    off = f14._beam_saving_row(4, trace, sp, None, 0.5)
    monkeypatch.setenv(sensitivity.CACHE_ENV, "1")
    first = f14._beam_saving_row(4, trace, sp, None, 0.5)
    assert f14._beam_saving_row(2, trace, sp, None, 0.5)["saving_pct"] != first["saving_pct"]  # keyed by width
    monkeypatch.setattr(f14, "simulate", lambda *a, **k: pytest.fail("read from the cache, not replayed"))
    assert f14._beam_saving_row(4, trace, sp, None, 0.5) == first == off
    assert off["saving_pct"] > 0 and off["width"] == 4
