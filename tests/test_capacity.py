"""The sustainable-rate measure (``pagedattn.repro.sim.capacity``): the capacity rule, the search's resolution, and that a rate
above a system's capacity no longer passes on a finite trace (issue 30, part 1)."""
import math

import numpy as np
import pandas as pd
import pytest

from pagedattn.repro.sim import capacity
from pagedattn.repro.sim.capacity import CAPACITY_MARGIN, Load, RateSearch, describe_ratio, ratio_resolution, sustainable_rate
from pagedattn.repro.workloads.traces import poisson_arrivals


def fifo_server(service_rate: float, num_requests: int = 2000, seed: int = 0, output_len: int = 10):
    """A replay function for one FIFO server doing ``service_rate`` requests/s (deterministic service)."""
    def replay(rate: float) -> pd.DataFrame:
        arrival = poisson_arrivals(num_requests, rate, seed)
        finish = np.empty(num_requests)
        free = 0.0
        for i, t in enumerate(arrival):
            free = max(free, t) + 1 / service_rate
            finish[i] = free
        return pd.DataFrame({"arrival_time": arrival, "finish_time": finish,
                             "output_len": np.full(num_requests, output_len)})
    return replay


def test_load_under_and_over_capacity():
    replay = fifo_server(10.0)
    under, over = Load.of(replay(5.0)), Load.of(replay(15.0))
    assert under.keeps_up() and under.completion_rate == pytest.approx(under.arrival_rate, rel=0.05)
    assert not over.keeps_up()
    assert over.completion_rate == pytest.approx(10.0, rel=0.02)  # the service rate, not the arrival rate
    assert over.verdict(threshold_s=math.inf) == "capacity"
    assert over.verdict(threshold_s=0.0) == "latency+capacity"


def test_offline_run_has_no_arrival_window():
    df = fifo_server(10.0, 100)(math.inf)
    load = Load.of(df)
    assert math.isinf(load.arrival_rate) and load.keeps_up()
    assert load.completion_rate == pytest.approx(10.0)


def test_latency_alone_overstates_capacity_on_a_finite_trace():
    """The review's finding, reproduced on a queue with a known capacity (10 req/s): with a latency threshold that
    tolerates the finite queue a short trace builds, latency alone passes rates well above capacity; the capacity
    rule stops the search within its margin of the true capacity."""
    replay = fifo_server(10.0, num_requests=400)
    threshold = 0.5  # s/token: 5 s over 10 tokens, the wait a 400-request trace builds at 12+ req/s
    latency_only = sustainable_rate(replay, 1.0, 100.0, threshold, margin=math.inf, offline=False)
    both = sustainable_rate(replay, 1.0, 100.0, threshold, offline=True)
    assert Load.of(replay(latency_only.rate)).arrival_rate > 11.0
    # the window receives exactly the nominal rate (``poisson_arrivals``), below the capacity within the margin
    arrived = Load.of(replay(both.rate)).arrival_rate
    assert arrived == pytest.approx(both.rate, rel=1e-9)
    assert 0.8 * 10.0 <= arrived <= 10.0 / (1 - CAPACITY_MARGIN)
    assert both.bound_by == "capacity"
    assert both.offline_rate == pytest.approx(10.0)
    assert both.completion_rate >= (1 - 2 * CAPACITY_MARGIN) * arrived


@pytest.mark.parametrize("resolution", [0.02, 0.1])
def test_search_reaches_its_resolution(resolution):
    found = sustainable_rate(fifo_server(7.0), 0.1, 500.0, 1.0, resolution, offline=False)
    assert 0 < found.resolution <= resolution
    assert found.failed_at == pytest.approx(found.rate * (1 + found.resolution))
    # rates are not on one coarse grid: the failing rate is within the resolution of the passing one
    assert found.failed_at / found.rate <= 1 + resolution
    row = found.row()
    assert row["sustainable_rate"] == found.rate and not row["at_bound"]


def test_search_bounds_are_reported():
    top = sustainable_rate(fifo_server(100.0), 0.1, 1.0, 1.0, offline=False)
    assert top.bound_by == "upper bound" and top.rate == 1.0 and math.isinf(top.resolution)
    bottom = sustainable_rate(fifo_server(0.001, 50), 10.0, 20.0, 1e-6, max_extensions=1, offline=False)
    assert bottom.bound_by == "lower bound" and bottom.rate == 0.0


def test_ratio_resolution_and_note():
    a = RateSearch(2.0, 2.04, 0.02, "latency", 2.0, 0.1, 9, offline_rate=2.5)
    b = RateSearch(1.0, 1.01, 0.01, "capacity", 1.0, 0.1, 9, offline_rate=1.25)
    assert ratio_resolution(a, b) == pytest.approx(1.02 * 1.01 - 1)
    note = describe_ratio(a.row() | {"resolution": a.resolution}, b.row() | {"resolution": b.resolution})
    assert "3.0 %" in note and "offline throughput ratio 2.00" in note and "latency at 2.04" in note


def test_simulated_rate_does_not_exceed_what_the_system_served():
    """On the simulator (a short ShareGPT-like trace, paper scale): the queue does not grow at the found rate, the
    search's failing rate fails a rule, and the capacity rule never raises the rate latency alone gives."""
    from pagedattn.repro.paper import paper_slots
    from pagedattn.repro.sim.simulator import CostModel, simulate
    from pagedattn.repro.workloads.traces import make_trace, with_rate

    base = make_trace("sharegpt_synthetic", 300, 1.0, 0)

    def replay(rate):
        return simulate(with_rate(base, rate, 0), "orca_oracle", paper_slots(), 16, CostModel(),
                        record_steps=False).requests

    found = sustainable_rate(replay, 0.1, 20.0, capacity.NL_THRESHOLD_S, 0.05)
    at = Load.of(replay(found.rate))
    assert at.keeps_up() and at.queue_growth <= CAPACITY_MARGIN * at.arrival_rate
    assert not Load.of(replay(found.failed_at)).verdict(capacity.NL_THRESHOLD_S) == "ok"
    # the capacity rule only ever lowers the rate that latency alone would give
    latency_only = sustainable_rate(replay, 0.1, 20.0, capacity.NL_THRESHOLD_S, 0.05, margin=math.inf)
    assert found.rate <= latency_only.rate


def test_offline_bracket_finds_what_the_whole_range_finds():
    """Starting from the offline throughput changes only the probes: the rate found agrees with a search over the
    whole range within the resolution, in fewer replays; and it still walks out of a wrong first bracket (a latency
    threshold far below capacity, or a range whose top is below the capacity)."""
    calls = []

    def replay(rate):
        calls.append(rate)
        return fifo_server(10.0, 1000)(rate)

    for threshold in (1.0, 0.02):  # capacity binds; latency binds far below capacity
        calls.clear()
        whole = sustainable_rate(replay, 0.01, 1000.0, threshold, offline=False)
        n_whole = len(calls)
        calls.clear()
        fast = sustainable_rate(replay, 0.01, 1000.0, threshold)
        assert fast.rate == pytest.approx(whole.rate, rel=0.05) and len(calls) < n_whole
        assert fast.resolution <= 0.02 and fast.offline_rate == pytest.approx(10.0) and fast.probes == len(calls)
    top = sustainable_rate(replay, 0.01, 3.0, 1.0)  # the caller's range ends below capacity
    assert top.bound_by == "upper bound" and top.rate == 3.0


@pytest.mark.parametrize("bracket", [(9.0, 9.5), (8.0, 8.4), (4.0, 4.2), (30.0, 33.0), (0.02, 0.03)])
def test_a_search_from_a_given_bracket_finds_what_the_offline_bracket_finds(bracket):
    """``sustainable_rate(bracket=...)`` (a shorter trace's answer, as ``length_agreed_search`` passes it) changes
    only the probes: the same rules and resolution, the same rate within the resolution, whether the capacity lies
    in the bracket, near it, far below or above it, or the bracket lies outside the range; fewer replays where the
    bracket holds the answer."""
    calls = []

    def replay(rate):
        calls.append(rate)
        return fifo_server(10.0, 1000)(rate)

    default = sustainable_rate(replay, 0.01, 40.0, 0.05, 0.05)  # latency binds near 9 req/s, below capacity (10)
    n_default = len(calls)
    calls.clear()
    found = sustainable_rate(replay, 0.01, 40.0, 0.05, 0.05, bracket=bracket)
    assert found.rate == pytest.approx(default.rate, rel=0.05) and found.resolution <= 0.05
    assert found.bound_by == default.bound_by and found.probes == len(calls)
    assert found.offline_rate == default.offline_rate
    if bracket == (9.0, 9.5):  # it holds the answer
        assert len(calls) < n_default


def test_a_callers_bracket_goes_to_the_first_length_and_an_unjudged_longer_search_doubles_again(monkeypatch):
    """``length_agreed_search``: a caller's first bracket (notebook 13's rate grid) is the first length's only; rates
    that agree on n and 2n are not enough while the longer search is unjudged (``RateSearch.judged``): the trace
    doubles again. Without ``knee`` the row has no knee columns."""
    seen = []

    def search(replay, lo, hi, threshold_s, resolution, bracket=None):
        n = replay(lo)
        seen.append((n, bracket))
        return RateSearch(5.0, 5.1, 0.02, "capacity", 5.0, 0.01, 1, trend_se=0.03 if n <= 20 else 0.0)
    monkeypatch.setattr(capacity, "sustainable_rate", search)
    found = capacity.length_agreed_search(lambda rate, n: n, 10, 1.0, 100.0, bracket=(2.0, 3.0))
    assert seen == [(10, (2.0, 3.0)), (20, (5.0, 5.1)), (40, (5.0, 5.1))]
    assert found.length_agreed and found.search_requests == 40 and found.judged
    assert "knee_rate" not in found.row() and math.isnan(found.knee_rate)


@pytest.mark.parametrize("n", [5, 150, 400, 1000, 3000])
def test_the_steady_window_receives_the_nominal_rate(n):
    """A rate is what the steady window receives (``poisson_arrivals``): exactly, for every trace length and seed,
    and one seed's arrival pattern is the same at every rate (one time scale)."""
    for seed in (0, 1):
        for rate in (0.5, 7.0):
            t = poisson_arrivals(n, rate, seed)
            start, end = capacity.steady_window(t)
            assert ((t >= start) & (t < end)).sum() / (end - start) == pytest.approx(rate, rel=1e-9)
        assert poisson_arrivals(n, 2.0, seed) == pytest.approx(poisson_arrivals(n, 1.0, seed) / 2)


def test_no_rate_above_the_offline_throughput_counts():
    """A system that keeps up online at rates above what it serves saturated (here: 10 req/s online, 6 req/s with the
    whole trace queued) is reported at its offline throughput, with that bound named, never above it."""
    def replay(rate):
        return fifo_server(6.0 if math.isinf(rate) else 10.0, 1000)(rate)

    found = sustainable_rate(replay, 0.1, 100.0, 10.0)
    assert found.offline_rate == pytest.approx(6.0)
    assert found.rate == found.offline_rate and found.bound_by == "offline throughput"
    assert found.resolution == 0.0 and not found.row()["at_bound"]


def test_a_trace_too_short_for_its_length_mix_is_not_judged():
    """Requests that each stay an exponentially distributed time in the system (mean 10 s, no queueing): at 1 req/s
    about 10 are in the system. On 100 requests, the count's slope from the mix of latencies alone (``trend_se``) is
    several percent of the arrival rate, more than half the margin; on 3,000 it is well under it."""
    def delay_server(num_requests):
        latency = np.random.default_rng(1).exponential(10.0, num_requests)

        def replay(rate):
            arrival = poisson_arrivals(num_requests, rate, 0)
            return pd.DataFrame({"arrival_time": arrival, "finish_time": arrival + latency,
                                 "output_len": np.full(num_requests, 100)})
        return replay

    short, long = Load.of(delay_server(100)(1.0)), Load.of(delay_server(3000)(1.0))
    assert short.in_system == pytest.approx(10.0, rel=0.3) and long.in_system == pytest.approx(10.0, rel=0.1)
    assert short.trend_se > capacity.MAX_TREND_SE and not short.judged
    assert long.trend_se < capacity.MAX_TREND_SE / 2 and long.judged
    short_search = sustainable_rate(delay_server(100), 0.5, 2.0, 1.0, offline=False)
    long_search = sustainable_rate(delay_server(3000), 0.5, 2.0, 1.0, offline=False)
    assert not short_search.judged and long_search.judged
    assert "NOT JUDGED" in describe_ratio(short_search.row(), long_search.row())
    assert "NOT JUDGED" not in describe_ratio(long_search.row(), long_search.row())


def test_trend_se_is_the_spread_of_shuffled_slopes():
    """``trend_se`` is what it says: constant latencies have no mix to shuffle (zero), and it scales with the rate
    like the slope it measures (relative to the arrival rate, it does not depend on the time unit)."""
    arrival = poisson_arrivals(500, 2.0, 0)
    const = pd.DataFrame({"arrival_time": arrival, "finish_time": arrival + 3.0, "output_len": np.full(500, 10)})
    assert Load.of(const).trend_se == pytest.approx(0.0, abs=1e-12)
    latency = np.random.default_rng(2).exponential(3.0, 500)
    a = pd.DataFrame({"arrival_time": arrival, "finish_time": arrival + latency, "output_len": np.full(500, 10)})
    b = a.assign(arrival_time=a.arrival_time * 60, finish_time=a.finish_time * 60)  # minutes instead of seconds
    assert Load.of(a).trend_se > 0 and Load.of(b).trend_se == pytest.approx(Load.of(a).trend_se, rel=1e-6)


def test_a_run_that_refused_a_request_has_no_normalized_latency():
    """The simulator fails a request that can never fit (``SchedulerOutputs.ignored``) at once, with no tokens: its row
    would count as served instantly. ``normalized_latency`` (and so ``Load`` and every search) refuses such a run,
    naming the limit, while the other requests of the replay are still served."""
    from pagedattn.repro.sim.simulator import simulate
    from pagedattn.repro.workloads.traces import TraceRequest

    trace = [TraceRequest("fits", 0.0, 40, 10), TraceRequest("too-long", 0.1, 900, 10),
             TraceRequest("fits-too", 0.2, 30, 10)]
    res = simulate(trace, "paged", 640)
    reqs = res.requests.set_index("request_id")
    assert reqs.loc["too-long", "error"] and reqs[["error"]].drop("too-long").isna().all().all()
    assert (reqs.drop("too-long").finish_time > reqs.drop("too-long").arrival_time).all()
    with pytest.raises(ValueError, match=r"1 of 3 requests were refused.*'too-long'.*num_gpu_blocks=40"):
        res.normalized_latency()
    with pytest.raises(ValueError, match="refused"):
        Load.of(res.requests)
    assert capacity.normalized_latency(res.requests.drop(columns="error")) > 0  # the rule reads the error column


def test_bound_names_what_stopped_the_search():
    """Issue 50, item 3: each search's row says whether the latency threshold or the capacity stopped it."""
    assert [capacity.bound(b) for b in ("latency", "latency+capacity", "capacity", "offline throughput",
                                        "upper bound", "lower bound")] == \
        ["latency", "latency", "capacity", "capacity", "range", "range"]
    assert sustainable_rate(fifo_server(10.0), 1.0, 40.0, threshold_s=100.0).row()["bound"] == "capacity"
    assert sustainable_rate(fifo_server(10.0), 1.0, 40.0, threshold_s=0.02).row()["bound"] == "latency"


def test_lengths_agree_within_their_resolution():
    """The n-vs-2n check: rates within their ratio's resolution agree; an offline-bound search (resolution 0)
    counts the 2 % resolution, the noise of a finite trace's offline throughput; a range end agrees with nothing."""
    def row(rate, res=0.02, by="capacity"):
        return {"sustainable_rate": rate, "resolution": res, "bound_by": by}
    assert capacity.lengths_agree(row(4.0), row(4.1))
    assert not capacity.lengths_agree(row(4.4), row(3.96))
    assert capacity.lengths_agree(row(4.0, 0.0, "offline throughput"), row(4.1, 0.0, "offline throughput"))
    assert not capacity.lengths_agree(row(4.0, math.inf, "upper bound"), row(4.0))


def test_length_rule_doubles_the_trace_until_the_rates_agree(monkeypatch):
    """``length_agreed_rate``: n, 2n, ... until n and 2n agree, each longer search from the shorter's bracket; never
    agreeing within the cap leaves the rate not judged, with the reason."""
    rates = {10: 5.0, 20: 4.5, 40: 4.45, 80: 4.44}
    seen = []

    def search(replay, lo, hi, threshold_s, resolution, bracket=None):
        n = replay(lo)
        seen.append((n, bracket))
        return RateSearch(rates[n], rates[n] * 1.02, 0.02, "capacity", rates[n], 0.01, 1)
    monkeypatch.setattr(capacity, "sustainable_rate", search)
    row = capacity.length_agreed_rate(lambda rate, n: n, 10, 1.0, 100.0, knee=False)
    assert [n for n, _ in seen] == [10, 20, 40] and seen[1][1] == (5.0, 5.1)
    assert row["length_agreed"] and row["search_requests"] == 40 and row["rate_at_half_length"] == 4.5
    assert row["sustainable_rate"] == 4.45 and row["bound"] == "capacity"
    seen.clear()
    row = capacity.length_agreed_rate(lambda rate, n: n, 10, 1.0, 100.0, knee=False, max_doublings=1)
    assert [n for n, _ in seen] == [10, 20] and not row["length_agreed"] and "never agreed" in row["length_reason"]


def test_length_rule_on_a_fifo_server_and_the_knee():
    """On a real replay the rule ends agreed, and the knee (3x the unloaded normalized latency) sits at or below
    the capacity of a FIFO server."""
    def replay(rate, n):
        return fifo_server(10.0, num_requests=n)(rate)
    row = capacity.length_agreed_rate(replay, 500, 1.0, 40.0, threshold_s=100.0, knee=True)
    assert row["length_agreed"] and row["sustainable_rate"] <= 10.0 * 1.02
    assert row["knee_threshold_s"] == pytest.approx(3 * Load.of(replay(1.0, row["search_requests"]))
                                                    .normalized_latency_s)
    assert 0 < row["knee_rate"] <= row["sustainable_rate"] * 1.02


def test_the_knee_reuses_the_last_searchs_replays_and_finds_what_it_finds_alone():
    """``length_agreed_search(knee=True)`` (issue 64): a replay is deterministic, so the knee's search takes the
    offline run, the rate and the rate that failed from the last search instead of replaying them; its answer is
    the one ``knee_rate`` finds on a fresh replay function, and no (rate, length) is replayed twice."""
    calls = []

    def replay(rate, n):
        calls.append((rate, n))
        return fifo_server(10.0, num_requests=n)(rate)
    found = capacity.length_agreed_search(replay, 500, 1.0, 40.0, threshold_s=100.0, knee=True)
    assert len(calls) == len(set(calls))
    at = found.search_requests
    alone = capacity.knee_rate(fifo_server(10.0, num_requests=at), 1.0, 40.0, found.row())
    assert (found.knee_rate, found.knee_threshold_s, found.knee_bound) == \
        (alone["knee_rate"], alone["knee_threshold_s"], alone["knee_bound"])
    reused = {(math.inf, at), (found.rate, at), (found.failed_at, at)}
    assert reused <= set(calls)
