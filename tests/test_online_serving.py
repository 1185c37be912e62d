"""Notebook 13's pieces (``experiments.online_serving``): the CPU step-time fit, the simulator run with it, and the
sustainable rate read off a rate grid with the capacity rule. The live-server sweep itself runs in the notebook test
(quick mode) and in ``tests/test_serve.py``'s end-to-end tests."""
import math

import numpy as np
import pandas as pd
import pytest

from pagedattn.repro.experiments import online_serving as O


def test_fit_recovers_a_known_step_time():
    rng = np.random.default_rng(0)
    n = rng.integers(1, 40, 200)
    ctx = n * rng.integers(20, 200, 200)
    dec = pd.DataFrame({"kind": "decode", "batch_size": n, "slots_filled": ctx, "num_prefill_tokens": 0,
                        "step_time": 1e-3 + 2e-4 * n + 3e-6 * ctx})
    tok = rng.integers(50, 2000, 20)
    pre = pd.DataFrame({"kind": "prefill", "batch_size": 1, "slots_filled": 0, "num_prefill_tokens": tok,
                        "step_time": 5e-4 + 4e-5 * tok})
    fit, err = O.fit_step_time(pd.concat([dec, pre]))
    assert (fit.decode_s, fit.decode_per_seq_s, fit.decode_per_context_token_s) == \
        (pytest.approx(1e-3), pytest.approx(2e-4), pytest.approx(3e-6))
    assert (fit.prefill_s, fit.prefill_per_token_s) == (pytest.approx(5e-4), pytest.approx(4e-5))
    assert err["decode_rel_rms"] < 1e-9 and fit.decode_time(10, 1000) == pytest.approx(1e-3 + 2e-3 + 3e-3)


def test_the_servers_cost_per_token_is_added_to_each_decoded_sequence():
    fit = O.FittedStepTime(decode_s=1e-3, decode_per_seq_s=1e-4)
    per_token = O.server_cost_per_token(in_process_s=2.0, served_s=3.0, tokens=10_000)
    served = O.with_server_cost(fit, per_token)
    assert per_token == pytest.approx(1e-4) and O.server_cost_per_token(3.0, 2.0, 10) == 0.0
    assert served.decode_per_seq_s == pytest.approx(1e-4 + 1e-4) and served.decode_s == 1e-3


def test_prediction_runs_the_simulator_on_the_servers_budget():
    p = O.Params.make(True)
    slow = O.FittedStepTime(decode_s=1e-2, prefill_per_token_s=1e-5)
    fast = O.FittedStepTime(decode_s=1e-3, prefill_per_token_s=1e-6)
    trace = p.trace(20.0)
    a, b = O.predict(trace, "paged", p, slow), O.predict(trace, "paged", p, fast)
    assert len(a) == len(trace) and (a.finish_time >= a.arrival_time).all()
    assert a.finish_time.max() > b.finish_time.max()  # a slower step, a later finish


def test_sustainable_rate_reads_the_grid_with_both_rules():
    rows = []
    for rate, nl, ok in ((1.0, 0.01, True), (2.0, 0.02, True), (3.0, 0.05, False), (4.0, 0.3, False)):
        rows.append({"system": "paged", "rate": rate, "nl_measured_s": nl, "keeps_up_measured": ok})
    got = O.sustainable(pd.DataFrame(rows), threshold_s=0.1, which="measured").iloc[0]
    assert got.sustainable_rate == 2.0 and got.resolution == pytest.approx(0.5)  # 3.0 keeps latency but not up
    none = O.sustainable(pd.DataFrame(rows).assign(nl_measured_s=1.0), 0.1, "measured").iloc[0]
    assert math.isnan(none.sustainable_rate)
