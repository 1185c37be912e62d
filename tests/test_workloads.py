"""Traces: the paper's Fig. 11 means after vLLM's filters, Poisson arrivals, and the ShareGPT loader."""
from pathlib import Path

import numpy as np
import pytest

from pagedattn.paper import TRACE_MEANS
from pagedattn.workloads import load_sharegpt, make_trace, poisson_arrivals, trace_stats, with_rate

FIXTURE = Path(__file__).parent / "fixtures" / "sharegpt_small.json"


@pytest.mark.parametrize("name", ["sharegpt", "alpaca"])
def test_means_match_fig11_after_filters(name):
    tr = make_trace(name, 20000, rate=1.0, seed=3)
    st = trace_stats(tr)
    assert st["input_mean"] == pytest.approx(TRACE_MEANS[name]["input"], rel=0.03)
    assert st["output_mean"] == pytest.approx(TRACE_MEANS[name]["output"], rel=0.03)
    assert all(4 <= r.prompt_len <= 1024 and r.output_len >= 4 and r.total_len <= 2048 for r in tr)


def test_seeded_and_poisson():
    assert make_trace("sharegpt", 50, 2.0, seed=1) == make_trace("sharegpt", 50, 2.0, seed=1)
    assert make_trace("sharegpt", 50, 2.0, seed=1) != make_trace("sharegpt", 50, 2.0, seed=2)
    t = poisson_arrivals(20000, rate=4.0, seed=0)
    gaps = np.diff(t)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.03) and np.std(gaps) == pytest.approx(0.25, rel=0.05)
    assert (poisson_arrivals(5, float("inf")) == 0).all()
    moved = with_rate(make_trace("alpaca", 10, 1.0), 5.0)
    assert [r.prompt_len for r in moved] == [r.prompt_len for r in make_trace("alpaca", 10, 1.0)]


def test_load_sharegpt_fixture():
    tr = load_sharegpt(FIXTURE, tokenize=str.split)
    # a2's prompt ("Hi") is under 4 tokens; a4 has a single turn; a5 none: only a1 and a3 remain
    assert [(r.prompt_len, r.output_len) for r in tr] == [(13, 19), (10, 39)]
    assert len(load_sharegpt(FIXTURE, num_requests=5, rate=2.0, seed=0)) == 5


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown trace"):
        make_trace("wikipedia", 3)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0)
