"""``experiments.gain_sources``: the measurements that explain Fig. 14's gains and Fig. 15's savings (tiny traces)."""
import math
from dataclasses import replace

import pandas as pd
import pytest

from pagedattn.repro.sim import parallel
from pagedattn.repro.experiments import gain_sources, sharing
from pagedattn.repro.sim.simulator import simulate
from pagedattn.repro.workloads.traces import make_trace


@pytest.fixture(autouse=True)
def one_job():
    parallel.configure(1)
    yield
    parallel.configure(None)


def tiny() -> sharing.Params:
    return sharing.Params.make(True, sim_requests={"alpaca": 40, "sharegpt": 20}, gain_requests=30,
                               gain_requests_n1=40, rate_resolution=0.5)


def test_decode_terms_product_is_exact():
    r = simulate(make_trace("alpaca", 60, 30.0, 0), "orca_oracle", num_slots=4096, n=1)
    t = gain_sources.decode_terms(r)
    assert t["decode_tokens_per_s"] == pytest.approx(t["batch_per_step"] / (t["decode_step_ms"] / 1000)
                                                     * t["decode_time_share"])
    assert sum(t[f"{k}_pct"] for k in gain_sources.SLOT_KINDS) == pytest.approx(100)
    assert t["reserved_pct"] > 0  # Orca (Oracle) holds its requests' future tokens
    assert 0 < t["decode_time_share"] <= 1 and t["context_per_seq"] > 0


def test_n1_gain_sources_and_factors():
    src = gain_sources.n1_gain_sources(tiny(), 40.0, 20.0, progress=False)
    assert list(src["at_rate"]) == ["own", "own", "orca_oracle's"] and list(src["rate"]) == [40.0, 20.0, 20.0]
    f = gain_sources.n1_gain_factors(src)
    assert f["gain (rate ratio)"] == pytest.approx(2.0)
    assert f["decode tokens/s ratio"] == pytest.approx(f["batch ratio"] * f["step-rate ratio (Orca step time / ours)"]
                                                       * f["decode time share ratio"])


def test_equal_sample_lengths_and_saving_causes():
    trace = make_trace("alpaca", 20, 10.0, 0)
    r = simulate(trace, "paged", num_slots=8192, n=3, equal_sample_lengths=True)
    assert (r.requests["total_output_len"] == 3 * r.requests["output_len"]).all()
    got = gain_sources.parallel_saving_causes(tiny(), traces=("alpaca",), widths=(2,), progress=False)
    assert set(got["sample_lengths"]) == {"independent", "equal"}
    assert got[["saving_time_weighted_pct", "saving_step_weighted_pct"]].gt(0).all().all()


def test_beam_saving_vs_parents_and_interpolation():
    t = gain_sources.beam_saving_vs_parents(tiny(), 4, (1.0, 4.0), progress=False)
    lo, hi = t.set_index("distinct_parents")["saving_pct"].loc[[4.0, 1.0]]
    assert hi > lo  # fewer distinct parents: more shared history
    table = pd.DataFrame({"distinct_parents": [2.0, 4.0], "saving_pct": [60.0, 40.0]})
    assert gain_sources.parents_for_saving(table, 50.0) == pytest.approx(3.0)
    assert math.isnan(gain_sources.parents_for_saving(table, 70.0))


def test_seq_cap_gains_rows():
    got = gain_sources.seq_cap_gains(tiny(), (2,), 512, progress=False)
    assert list(got["width"]) == [1, 2] and set(got["max_num_seqs"]) == {512}
    assert (got["gain"] == got["rate_paged"] / got["rate_orca_oracle"]).all()


def test_seq_cap_gains_parallel_rows():
    got = gain_sources.seq_cap_gains(tiny(), (2,), 512, progress=False, method="parallel")
    assert list(got["method"]) == ["n=1", "parallel"] and list(got["width"]) == [1, 2]
    assert (got["gain"] == got["rate_paged"] / got["rate_orca_oracle"]).all()
    with pytest.raises(ValueError, match="method"):
        gain_sources.seq_cap_gains(tiny(), (2,), 512, progress=False, method="sampling")


def test_batch_split_terms_see_the_cap():
    r = simulate(make_trace("alpaca", 40, math.inf, 0), "paged", num_slots=8192, max_num_seqs=4)
    t = gain_sources.batch_split_terms(r, 4)
    assert t["saturated_batch"] <= 4 and t["at_cap_share"] > 0.5  # offline, roomy memory: the cap binds
    assert t["waiting_share"] > 0 and t["slots_per_request"] > 0 and 0 < t["kv_held_pct"] <= 100
    assert math.isnan(gain_sources.batch_split_terms(r, 4, n=2)["at_cap_share"])  # requests, not samples


def test_n1_batch_split_and_factors():
    split = gain_sources.n1_batch_split(replace(tiny(), gain_requests_n1=400), 40.0, 20.0, progress=False)
    assert len(split) == 2 * len(gain_sources.BATCH_SPLIT_RUNS)
    s = split.set_index(["system", "run"])
    # Orca (Oracle) reserves each request's final length: a running request holds more slots than ours
    assert s.loc[("orca_oracle", "offline, cap lifted"), "slots_per_request"] > \
        s.loc[("paged", "offline, cap lifted"), "slots_per_request"]
    f = gain_sources.batch_split_factors(split)
    assert f["memory: requests that fit (offline, cap lifted)"] > 1
    assert f["batch ratio at capacity"] == pytest.approx(
        f["memory: requests that fit (offline, cap lifted)"] * f["cap: offline batch at the cap / lifted"]
        * f["arrivals: batch at capacity / offline at the cap"])
    note = gain_sources.batch_split_note(f, 30.0, 1.82)
    assert "memory" in note and "1.82x" in note
    short = gain_sources.n1_batch_split(tiny(), 40.0, 20.0, progress=False)  # 40 requests fit at once: no split
    assert "not split" in gain_sources.batch_split_note(gain_sources.batch_split_factors(short), 30.0, 1.82)


def test_parallel_cap_use_and_notes():
    gain = pd.DataFrame([{"method": "n=1", "width": 1, "preemption": "vllm", "rate_paged": 30.0,
                          "rate_orca_oracle": 20.0},
                         {"method": "parallel", "width": 2, "preemption": "vllm", "rate_paged": 15.0,
                          "rate_orca_oracle": 10.0}])
    use = gain_sources.parallel_cap_use(tiny(), gain, progress=False)
    assert len(use) == 8 and set(use.max_num_seqs) == {256, gain_sources.LIFTED_SEQ_CAP}
    assert "at n = 2" in gain_sources.memory_bound_note(use)
    at_default = pd.Series({1: 1.7, 4: 2.2, 6: 2.0})
    lifted = pd.DataFrame({"method": ["n=1", "parallel", "parallel"], "width": [1, 4, 6], "max_num_seqs": 2048,
                           "gain": [1.7, 2.2, 2.4]})
    assert "the cap explains the fall at n = 6" in gain_sources.seq_cap_note(lifted, at_default)
    assert "does not explain" in gain_sources.seq_cap_note(lifted.assign(gain=[1.7, 2.2, 1.9]), at_default)
    assert "does not fall" in gain_sources.seq_cap_note(lifted, pd.Series({1: 1.7, 4: 2.2, 6: 2.3}))


def test_equal_sample_lengths_gains_stretch_and_note():
    p = tiny()
    st = gain_sources.sample_length_stretch(p, (1, 4))
    assert list(st.mean_stretch.round(6))[0] == 1.0 and st.mean_stretch.iloc[1] > 1  # the longest of 4 draws
    eq = gain_sources.seq_cap_gains(p, (2,), 256, progress=False, method="parallel", equal_sample_lengths=True)
    assert eq.equal_sample_lengths.all() and (eq["gain"] == eq["rate_paged"] / eq["rate_orca_oracle"]).all()
    assert gain_sources.rise_over_n1(pd.Series({1: 1.6, 2: 2.0, 4: 1.8})) == pytest.approx(0.25)
    flat = pd.DataFrame({"width": [1, 4, 6], "gain": [1.7, 1.72, 1.65]})
    assert "most of the rise" in gain_sources.equal_lengths_note(flat, pd.Series({1: 1.7, 4: 2.2, 6: 2.0}))
    assert "most of the rise" not in gain_sources.equal_lengths_note(flat.assign(gain=[1.7, 2.1, 2.0]),
                                                                      pd.Series({1: 1.7, 4: 2.2, 6: 2.0}))


def test_fig14_headline_preempts_by_vllms_rule(monkeypatch, tmp_path):
    """Issue 61: Fig. 14's headline gains preempt as the paper's vLLM did, which is the scheduler's default: a
    single-sequence group recomputed, a multi-sequence group swapped; forced swapping is only n = 1's sensitivity row."""
    from pagedattn.config import SchedulerConfig
    from pagedattn.repro.sim.simulator import HEADLINE_RULE, PREEMPTION_RULES

    assert PREEMPTION_RULES[HEADLINE_RULE] == SchedulerConfig().preemption_mode
    p = tiny()
    tight = make_trace("alpaca", 30, 200.0, 0)  # all at once into room for a few requests: preemption is certain
    for n, rule, only in ((1, HEADLINE_RULE, "recompute"), (1, "forced_swap", "swap")):
        r = simulate(tight, "paged", 16 * 60, 16, n=n, seed=0, **sharing.preemption(p, rule))
        assert r.num_preemptions[only] > 0 and sum(r.num_preemptions.values()) == r.num_preemptions[only], rule
    # two samples: swapped while both run (a group left with one running sample is a single-sequence group)
    assert simulate(tight, "paged", 16 * 60, 16, n=2, seed=0, **sharing.preemption(p)).num_preemptions["swap"] > 0
    # the searches behind the headline rows pass exactly those arguments to every replay
    monkeypatch.setenv("PAGEDATTN_SENSITIVITY_CACHE", str(tmp_path))
    seen = []

    def spy(*args, **kw):
        seen.append((kw["preemption_mode"], kw["num_cpu_blocks"]))
        return simulate(*args, **kw)
    monkeypatch.setattr(sharing, "simulate", spy)
    sharing.sim_rate(p, "paged", 1, make_trace("alpaca", p.gain_requests_n1, 1.0, p.seed), sharing.CostModel())
    assert seen and set(seen) == {("recompute", p.sim_cpu_blocks)}
    assert sharing._rules(1) == (HEADLINE_RULE, "forced_swap") and sharing._rules(4) == (HEADLINE_RULE,)
