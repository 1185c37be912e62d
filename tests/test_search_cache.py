"""Issue 64: each simulator search once (``sensitivity.cached_search``), and no result moves: the quick run's searches
give the same claims, value for value, with the cache off (``PAGEDATTN_SEARCH_CACHE=0``), with it filling, and read back
from it."""
from __future__ import annotations

import math
from dataclasses import asdict
from functools import partial

import pandas as pd
import pytest

from pagedattn.repro.experiments import block_size, chatbot, sensitivity, shared_prefix, sharing, throughput
from pagedattn.repro.sim import parallel
from pagedattn.repro.sim.simulator import CostModel
from pagedattn.repro.workloads.traces import make_trace


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_SENSITIVITY_CACHE", str(tmp_path))
    parallel.configure(jobs=1)
    yield tmp_path
    parallel.configure()


#: the modules whose replays a cached search must not run (``simulate`` as each imported it)
REPLAYING = (throughput, chatbot, shared_prefix, sharing, block_size)


def _searches() -> tuple[pd.DataFrame, list]:
    """A representative part of the quick run's searches, one or more per kind of call site, with the quick run's
    parameters: notebook 03's rate ratios (the trace-length rule and the knee), 09's chatbot rates, 07's shared-prefix
    rates at both thresholds, 04's (and 11's) Fig. 14 rate with n = 2 and 05's knee rate; and the claims made of
    03's."""
    p = throughput.SimParams.make(True)
    rates = throughput.sim_sustainable(p, False, traces=("sharegpt",), systems=("orca_oracle", "paged"))
    cp = chatbot.Params.make(True)
    base = chatbot.base_trace(chatbot.TRACE, cp.num_requests, cp.seed)
    rows = [chatbot._sustainable_row(s, base, cp, None) for s in ("orca_max", "paged")]
    rows += shared_prefix._rate_ratio_rows(("one_shot", "paged_auto"), shared_prefix.NL_THRESHOLDS_S,
                                           shared_prefix.Params.make(True), None)
    sp = sharing.Params.make(True)
    fig14 = sharing.sim_rate(sp, "paged", 2, make_trace("alpaca", sp.gain_requests, 1.0, sp.seed), CostModel())
    rows += [{"search": "fig14", **asdict(fig14)},
             {"search": "knee", "rate": block_size.knee_rate("sharegpt", block_size.Params.make(True))}]
    table = pd.concat([rates, pd.DataFrame(rows)], ignore_index=True)
    return table, [asdict(c) for c in throughput.rate_ratio_claims(rates)]


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b) or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == b)


def test_cache_on_and_off_give_the_same_claims(cache, monkeypatch):
    monkeypatch.setenv(sensitivity.CACHE_ENV, "0")
    off_table, off_claims = _searches()
    assert not list(cache.iterdir())  # nothing stored with the cache off
    monkeypatch.delenv(sensitivity.CACHE_ENV)
    fill_table, fill_claims = _searches()
    stored = list(cache.glob("*.json"))
    assert len(stored) == 2 + 2 + 2 + 1 + 1  # one entry per search

    def no_replay(*a, **k):
        raise AssertionError("a cached search replayed the simulator")
    for module in REPLAYING:
        monkeypatch.setattr(module, "simulate", no_replay)
    read_table, read_claims = _searches()  # every search read back
    for table in (fill_table, read_table):
        pd.testing.assert_frame_equal(off_table, table, check_exact=True)
    assert off_claims and all(_same(off_claims, c) for c in (fill_claims, read_claims))
    assert not list(cache.glob("*.tmp"))  # written atomically: no temporary file left


def test_another_key_is_another_search(cache):
    """The key names the search: another range (or trace, system, step time) misses the cache."""
    calls = []

    def search():
        calls.append(1)
        return sensitivity.RateSearch(1.0, 1.02, 0.02, "capacity", 1.0, 0.1, 3)
    a = sensitivity.cached_search({"fn": "t", "lo": 1.0}, search)
    assert _same(asdict(sensitivity.cached_search({"fn": "t", "lo": 1.0}, search)), asdict(a)) and len(calls) == 1
    sensitivity.cached_search({"fn": "t", "lo": 2.0}, search)
    assert len(calls) == 2


def test_a_search_with_the_knee_answers_the_same_search_without_it(cache, monkeypatch):
    """The knee is taken after the search has found its rate, so a stored search with the knee
    (``sharing.sim_rate(..., knee=True)``) answers the one without it: read back without its knee columns, the same
    value for value as that search run with the cache off, and no replay."""
    sp = sharing.Params.make(True)
    trace = make_trace("alpaca", sp.gain_requests, 1.0, sp.seed)
    monkeypatch.setenv(sensitivity.CACHE_ENV, "0")
    fresh = sharing.sim_rate(sp, "paged", 2, trace, CostModel())
    monkeypatch.delenv(sensitivity.CACHE_ENV)
    with_knee = sharing.sim_rate(sp, "paged", 2, trace, CostModel(), knee=True)
    assert with_knee.knee_rate > 0 and math.isnan(fresh.knee_rate)

    def no_replay(*a, **k):
        raise AssertionError("the search without the knee replayed the simulator")
    monkeypatch.setattr(sharing, "simulate", no_replay)
    assert _same(asdict(sharing.sim_rate(sp, "paged", 2, trace, CostModel())), asdict(fresh))
    assert len(list(cache.glob("*.json"))) == 1  # nothing stored for it


def test_the_chatbot_band_runs_its_searches_first_and_its_points_then_search_nothing(cache, monkeypatch):
    """``sensitivity.prefetch`` (issue 64): notebook 09's band as one task per (system, point) search; with them in
    the search cache, the points themselves (``chatbot.claims_at``) run no search, so only the order of the work
    changed. With the cache off, ``prefetch`` runs nothing (nothing would be kept for the points to read)."""
    cp = chatbot.Params.make(True)
    base = chatbot.base_trace(chatbot.TRACE, cp.num_requests, cp.seed)
    others = [p for p in sensitivity.points(True, rate_axis=False, trace_axis=False) if not p.is_default]
    jobs = [(s, p) for p in others for s in chatbot.ITERATION_LEVEL]
    ran = []
    monkeypatch.setenv(sensitivity.CACHE_ENV, "0")
    sensitivity.prefetch(ran.append, jobs, "off")
    assert ran == []
    monkeypatch.delenv(sensitivity.CACHE_ENV)
    sensitivity.prefetch(ran.append, jobs, "on")
    assert ran == jobs
    sensitivity.prefetch(partial(chatbot.band_search, base=base, params=cp), jobs, "chatbot band searches")
    assert len(list(cache.glob("*.json"))) == len(jobs)
    searched = []
    monkeypatch.setattr(chatbot, "length_agreed_search", lambda *a, **k: searched.append(a))
    for p in others:
        assert chatbot.claims_at(p, base, cp)
    assert searched == []
