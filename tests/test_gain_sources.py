"""``experiments.gain_sources``: the measurements that explain Fig. 14's gains and Fig. 15's savings (tiny traces)."""
import math

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
