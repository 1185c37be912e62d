"""Notebook 13's pieces (``experiments.online_serving``): the CPU step-time fit, the server's costs, the simulator
run with them, the sustainable-rate search (``capacity.sustainable_rate``) and vLLM-CPU's rate read off its grid. The
live-server sweep itself runs in the notebook test (quick mode) and in ``tests/test_serve.py``'s end-to-end tests."""
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import OPTForCausalLM

from pagedattn.repro.experiments import vllm_cpu
from pagedattn.repro.experiments import online_serving as O
from pagedattn.repro.experiments.common import tiny_opt


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


def test_server_cost_from_a_low_rate_trace_and_the_offline_run():
    n = np.array([1, 5, 20, 60, 200])
    local = pd.DataFrame({"request_id": list("abcde"), "arrival_time": np.arange(5.0), "output_len": n})
    local["finish_time"] = local.arrival_time + 1e-3 * n
    served = local.assign(finish_time=local.finish_time + 5e-3 + 6e-4 * n).iloc[::-1]  # any order
    offline = {"in_process_s": 0.2, "offline_steps": 200, "tokens": 4400}
    c = O.measure_server_cost(served, local, offline_served_s=1.2, offline=offline)
    # delay + (step + token) x tokens at batch one; 1.0 s offline = 200 steps x step_s + 4400 tokens x token_s
    assert c.request_delay_s == pytest.approx(5e-3) and c.step_s + c.token_s == pytest.approx(6e-4)
    assert 200 * c.step_s + 4400 * c.token_s == pytest.approx(1.0)
    fit = O.with_server_cost(O.FittedStepTime(decode_s=1e-3, decode_per_seq_s=1e-4), c)
    assert fit.decode_time(10, 0) == pytest.approx(1e-3 + c.step_s + 10 * (1e-4 + c.token_s))
    assert fit.prefill_time(100, 2) == pytest.approx(c.step_s + 2 * c.token_s)
    assert fit.request_delay_s == pytest.approx(5e-3)
    cheap = O.measure_server_cost(local, local, offline_served_s=0.1, offline=offline)  # nothing added: all zero
    assert (cheap.request_delay_s, cheap.step_s, cheap.token_s) == pytest.approx((0, 0, 0), abs=1e-12)


def test_calibration_takes_the_median_of_each_cost_over_its_repeats(monkeypatch):
    """``calibrate``: ``calibration_repeats`` measurements, each a served run and the same engine in-process, on the
    same calibration requests; each server cost is the median over them (one slow moment, here the second repeat's
    114 ms delay, moves nothing), and the budget rule's step time is the fit of the repeat with the median in-process
    time plus those costs. The server warms up before the first repeat only."""
    import contextlib

    p = O.Params.make(True, calibration_repeats=3, url="http://x")
    costs = iter([O.ServerCost(0.008, 1.2e-3, 2e-4), O.ServerCost(0.114, 4.7e-3, 3e-4), O.ServerCost(0.011, 1.5e-3,
                                                                                                     1e-4)])
    in_process = iter([0.8, 1.2, 0.9])
    lows = []
    monkeypatch.setattr(O, "_Endpoint", lambda url: contextlib.nullcontext(type("E", (), {"url": url})))
    warm = []
    monkeypatch.setattr(O, "measure_offline", lambda url, trace, vocab, bar, warm_up: (warm.append(warm_up), 2.0)[1])
    monkeypatch.setattr(O, "send", lambda url, low, vocab: (lows.append(low), pd.DataFrame())[1])

    def step_time(model, params, system, low):
        s = next(in_process)
        return O.FittedStepTime(decode_s=s), {"in_process_s": s}, pd.DataFrame()
    monkeypatch.setattr(O, "measure_step_time", step_time)
    monkeypatch.setattr(O, "measure_server_cost", lambda served, local, span, calib: next(costs))
    c = O.calibrate(p, model=None, checkpoint="")
    assert c["server_cost"] == O.ServerCost(0.011, 1.5e-3, 2e-4)
    assert c["cost"].decode_s == pytest.approx(0.9 + 1.5e-3) and c["cost"].request_delay_s == 0.011
    assert len(c["repeats"]) == 3 and list(c["repeats"].request_delay_s) == [0.008, 0.114, 0.011]
    assert len(lows) == 3 and all(low is lows[0] for low in lows) and c["low"] is lows[0]
    assert warm == [True, False, False]  # one server: its warm-up once


def test_the_request_delay_adds_to_latency_from_the_arrival():
    p = O.Params.make(True)
    cost = O.FittedStepTime(decode_s=1e-3, prefill_per_token_s=1e-6)
    trace = p.trace(0.5)  # far apart: no queueing
    a, b = O.predict(trace, "paged", p, cost), O.predict(trace, "paged", p, O.replace(cost, request_delay_s=0.01))
    assert (b.arrival_time.to_numpy() == a.arrival_time.to_numpy()).all()
    assert (b.finish_time - a.finish_time).to_numpy() == pytest.approx(0.01)


def test_prediction_runs_the_simulator_on_the_servers_budget():
    p = O.Params.make(True)
    slow = O.FittedStepTime(decode_s=1e-2, prefill_per_token_s=1e-5)
    fast = O.FittedStepTime(decode_s=1e-3, prefill_per_token_s=1e-6)
    trace = p.trace(20.0)
    a, b = O.predict(trace, "paged", p, slow), O.predict(trace, "paged", p, fast)
    assert len(a) == len(trace) and (a.finish_time >= a.arrival_time).all()
    assert a.finish_time.max() > b.finish_time.max()  # a slower step, a later finish


def test_budget_rule_judges_every_system_at_its_own_simulated_sustainable_rate():
    """``Params.slots``' rule, simulator only: at each budget (halving from notebook 03's) every system of the run,
    Orca (Max) predicted only included, gets its simulated sustainable rate there (``simulated_rate``, the sweep's
    ``search`` on the simulator) and its memory-bound share at that rate (issue 52's decision; no longer the paged
    system alone at 40 % of the CPU's capacity); the budget's share is the least of them. With a step cost per
    sequence only, batching buys nothing and memory never binds: the smallest budget that admits every request is
    taken, and the table says that none qualified."""
    p = O.Params.make(True, search_requests=50)
    per_seq = O.FittedStepTime(decode_s=1e-5, decode_per_seq_s=5e-4, prefill_s=1e-5, prefill_per_token_s=1e-6)
    slots, table = O.budget_rule(p, per_seq)
    assert table.slots.tolist()[:2] == [p.reference_slots, p.reference_slots // 2]  # halving from notebook 03's
    systems = O.paper_systems(p)
    assert systems == ["orca_max", "orca_oracle", "paged"]  # Orca (Max) predicted only, still judged
    judged = table[table.admitted]
    for _, row in judged.iterrows():
        assert row.memory_bound_share == min(row[f"memory_bound_share.{s}"] for s in systems)
        assert all(row[f"rate.{s}"] > 0 for s in systems)
    assert table.threshold_s.nunique() == 1  # one threshold for every budget: the CPU-bound paged system's
    rate, share = O.simulated_rate(p, "paged", per_seq, int(slots), float(table.threshold_s.iloc[0]))
    chosen = table[table.chosen].iloc[0]
    assert (rate, share) == (chosen["rate.paged"], chosen["memory_bound_share.paged"])  # deterministic
    assert not table.qualifies.any() and slots == judged.slots.min()
    assert not table.admitted.iloc[-1] and "orca_max" in table.refused.iloc[-1]  # Orca (Max)'s 512-slot reservation
    assert O.replace(p, num_slots=slots).slots == slots and p.slots == p.reference_slots == 3932  # 15.7K / 4


def test_budget_rule_takes_the_largest_budget_where_every_system_is_memory_bound(monkeypatch):
    """The rule's choice, with the simulated shares given: a budget qualifies only when every system is memory-bound
    in at least ``memory_bound_min_pct`` % of its steady steps at its sustainable rate (at 1966 slots the paged
    system is, Orca (Oracle) is not); the largest that qualifies is taken."""
    p = O.Params.make(True, search_requests=50)
    shares = {3932: {"paged": 0.5, "orca_oracle": 0.95, "orca_max": 0.99},
              1966: {"paged": 0.95, "orca_oracle": 0.8, "orca_max": 0.99},
              983: {"paged": 0.92, "orca_oracle": 0.97, "orca_max": 1.0}}
    monkeypatch.setattr(O, "simulated_rate", lambda params, system, cost, slots, threshold: (1.0,
                                                                                            shares[slots][system]))
    cost = O.FittedStepTime(decode_s=5e-3, decode_per_seq_s=1e-6, prefill_s=1e-3, prefill_per_token_s=1e-7)
    slots, table = O.budget_rule(p, cost)
    assert slots == 983 and table.slots.tolist() == [3932, 1966, 983]  # stops at the first that qualifies
    assert table.qualifies.tolist() == [False, False, True] and table.memory_bound_share.tolist() == [0.5, 0.8, 0.92]
    assert "Orca (Oracle) 97 %" in O._budget_words(O.replace(p, num_slots=slots), table)


def test_refusals_name_the_budget_no_request_fits():
    p = O.Params.make(True)
    traces = [p.trace(math.inf)]
    assert O.refusals(traces, p.reference_slots, p) == []
    refused = O.refusals(traces, 256, p)  # below Orca (Max)'s reservation of the max length (512)
    assert any(r.startswith("orca_max:") for r in refused)
    assert O.refusals(traces, 16, p) and any(r.startswith("paged:") for r in O.refusals(traces, 16, p))


def test_search_is_a_capacity_search_with_the_offline_rule_and_its_resolution():
    p = O.Params.make(True, search_requests=30, rate_resolution=0.05)
    cost = O.FittedStepTime(decode_s=2e-3, decode_per_seq_s=1e-4, prefill_per_token_s=1e-5)
    offline = len(p.trace(math.inf, 60)) / float(O.predict(p.trace(math.inf, 60), "paged", p, cost).finish_time.max())
    row = O.search(lambda rate, n: O.predict(p.trace(rate, n), "paged", p, cost), offline, p, 0.05)
    assert len(p.trace(1.0, 60)) == 60 and len(p.trace(1.0)) == p.num_requests  # the curves keep num_requests
    assert {"sustainable_rate", "resolution", "bound_by", "failed_at", "offline_rate", "trend_se", "judged",
            "probes", "threshold_s", "search_s", "search_requests", "rate_at_half_length", "length_agreed"} <= set(row)
    # one length (issue 64: tracking searches, the trace-length rule not applied): no half-length rate, no verdict
    assert row["search_requests"] == 30 and p.longest_search_requests == 30 and p.max_length_doublings == 0
    assert math.isnan(row["rate_at_half_length"]) and row["length_agreed"] is None and row["length_reason"] == ""
    assert 0 < row["sustainable_rate"] <= row["offline_rate"] and row["probes"] >= 3
    assert row["resolution"] <= 0.05 or row["bound_by"] == "offline throughput"


def test_rows_and_searches_carry_the_replay_clients_cpu_and_the_simulated_memory_bound_share():
    p = O.Params.make(True, search_requests=30)
    cost = O.FittedStepTime(decode_s=2e-3, decode_per_seq_s=1e-4, prefill_per_token_s=1e-5)

    def live(rate, n=60):  # a stand-in for ``send``: the simulator's frame with a client's CPU and wall time attached
        df = O.predict(p.trace(rate, n), "paged", p, cost)
        df.attrs.update(client_cpu_s=0.5, client_wall_s=2.0 if math.isinf(rate) else 1.0)
        df["ttft_s"] = df["tpot_s"] = 0.0
        return df
    row = O._row("paged", 20.0, 0.4, live(20.0), O.predict(p.trace(20.0, 60), "paged", p, cost, steps=True))
    assert row["client_cpu_s"] == 0.5 and row["client_cpu_share"] == 0.5
    assert 0 <= row["memory_bound_share_predicted"] <= 1
    assert math.isnan(O._row("paged", 20.0, 0.4, live(20.0), None)["memory_bound_share_predicted"])
    found = O.search(live, 40.0, p, 0.05)
    assert found["client_cpu_s_per_probe"] == 0.5 and found["client_cpu_share_max"] == 0.5
    sim = O.search(lambda rate, n: O.predict(p.trace(rate, n), "paged", p, cost), 40.0, p, 0.05)
    assert math.isnan(sim["client_cpu_s_per_probe"])  # a prediction has no client


def test_vllm_rate_is_read_off_its_grid_with_both_rules():
    rows = []
    for rate, nl, ok in ((1.0, 0.01, True), (2.0, 0.02, True), (3.0, 0.05, False), (4.0, 0.3, False)):
        rows.append({"system": O.VLLM, "rate": rate, "nl_measured_s": nl, "keeps_up_measured": ok,
                     "throughput_measured": 0.9 * rate})
    got = O.grid_sustainable(pd.DataFrame(rows).sample(frac=1, random_state=0), threshold_s=0.1, system=O.VLLM)
    assert got["sustainable_rate"] == 2.0 and got["resolution"] == pytest.approx(0.5)  # 3.0: latency ok, not up
    assert got["throughput_at_rate"] == pytest.approx(1.8) and got["nl_at_rate_s"] == 0.02  # that grid point's own
    assert got["bound_by"] == "rate grid" and got["which"] == "measured" and got["failed_at"] == 3.0
    assert got["system"] == O.VLLM
    assert math.isnan(O.grid_sustainable(pd.DataFrame(rows).assign(nl_measured_s=1.0), 0.1, O.VLLM)["sustainable_rate"])


def test_orca_max_is_predicted_only():
    """Issue 52: Orca (Max) leaves the live sweep (its live rate grid never yielded a rate) and stays predicted: a
    curve point of it has the prediction only, and it is no live server's system."""
    for quick in (False, True):
        p = O.Params.make(quick)
        assert "orca_max" not in p.systems and "orca_max" in p.predicted and "orca_max" in O.paper_systems(p)
    p = O.Params.make(True)
    cost = O.FittedStepTime(decode_s=2e-3, decode_per_seq_s=1e-4, prefill_per_token_s=1e-5)
    row = O._row("orca_max", 5.0, 0.4, None, O.predict(p.trace(5.0), "orca_max", p, cost, steps=True))
    assert row["nl_predicted_s"] > 0 and 0 <= row["memory_bound_share_predicted"] <= 1
    assert all(math.isnan(row[k]) for k in ("nl_measured_s", "nl_error_pct", "throughput_measured", "ttft_p50_s"))
    assert row["keeps_up_measured"] is False


def test_a_served_systems_live_rate_off_its_grid_and_its_ratio_says_so():
    """``Params.searched``: a served system left out of it (here Orca (Max), as served before issue 52) gets its
    live rate from its grid (no live search), its prediction is searched, and the measured ratio's note says how
    each rate was found; the paged and Orca (Oracle) ratio stays searched."""
    assert {"paged", "orca_oracle"} <= set(O.Params().searched)
    grid = pd.DataFrame([{"system": "orca_max", "rate": r, "nl_measured_s": nl, "keeps_up_measured": ok,
                          "throughput_measured": r}
                         for r, nl, ok in ((1.0, 0.01, True), (1.75, 0.02, True), (2.5, 0.5, False))])
    cur = pd.concat([grid, grid.assign(system="paged")]).assign(nl_predicted_s=0.02, keeps_up_predicted=True,
                                                               nl_error_pct=10.0)
    sus = pd.DataFrame([_found("paged", "measured", 7.0), O.grid_sustainable(grid, 0.1, "orca_max"),
                        _found("paged", "predicted", 6.0), _found("orca_max", "predicted", 2.0)])
    cl = {c.name: c for c in O.claims(cur, sus)}
    m, p = cl["online.rate_ratio.paged_vs_orca_max.measured"], cl["online.rate_ratio.paged_vs_orca_max.predicted"]
    assert m.ours == 4.0 and "Orca (Max)'s read off its rate grid" in m.note and "rate grid at 2.5" in m.note
    assert "ratio resolution 48.6 %" in m.note  # (1 + 0.04) x 2.5 / 1.75 - 1
    assert p.ours == 3.0 and "rates searched on 600 requests" in p.note and "grid" not in p.note


# ------------------------------------------------------------------------------------------ vLLM-CPU joins
from pagedattn.repro.experiments import vllm_cpu  # noqa: E402


@pytest.fixture
def no_vllm(monkeypatch, tmp_path):
    """No vLLM venv anywhere: neither ``$VLLM_VENV`` nor the repository's ``.venv-vllm``."""
    monkeypatch.delenv("VLLM_VENV", raising=False)
    monkeypatch.setattr(vllm_cpu, "DEFAULT_VENV", tmp_path / "absent")
    return tmp_path


def fake_venv(root, installed=True):
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").touch()
    if installed:
        (root / ".installed").touch()
    return root


def test_vllm_is_skipped_without_its_venv(no_vllm):
    assert O.Params.make(False).vllm is False  # issue 52: not in the default full run
    auto = O.Params.make(False, vllm=None)
    assert auto.vllm is None and O._vllm_python(auto) is None
    assert "not found" in O.vllm_note(auto, None) and "make vllm-venv" in O.vllm_note(auto, None)
    with pytest.raises(FileNotFoundError):
        O._vllm_python(O.Params.make(False, vllm=True))


def test_vllm_joins_where_its_venv_is_and_never_in_quick_mode(no_vllm, monkeypatch):
    venv = fake_venv(no_vllm / "v")
    monkeypatch.setenv("VLLM_VENV", str(venv))
    assert O._vllm_python(O.Params.make(False, vllm=None)) == venv / "bin" / "python"  # auto: where it is
    assert O._vllm_python(O.Params.make(False)) is None  # the default full run leaves it out (issue 52)
    assert O._vllm_python(O.make_params(False, url=None, vllm=True)) == venv / "bin" / "python"  # VLLM=1
    assert O._vllm_python(O.Params.make(True)) is None  # quick mode (CI) never starts vLLM
    assert O._vllm_python(O.make_params(True, url=None, vllm=None)) is None  # as the notebook passes them
    assert O._vllm_python(O.make_params(False, url=None, vllm=None)) is None
    assert O._vllm_python(O.Params.make(False, url="http://example:8000")) is None  # the endpoint is what's measured
    assert O._vllm_python(O.Params.make(False, vllm=False)) is None
    half = fake_venv(no_vllm / "half", installed=False)  # an install that did not finish
    assert vllm_cpu.find_python(half) is None


def test_vllm_server_command_carries_the_settings():
    p = O.Params.make(False, threads=1)
    s = O.Server.vllm("/venv/bin/python", "/ckpt", p)
    cmd = s.cmd
    arg = dict(zip(cmd, cmd[1:]))
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"] and arg["--model"] == "/ckpt"
    assert {"--skip-tokenizer-init", "--no-enable-prefix-caching", "--no-enable-chunked-prefill"} <= set(cmd)
    assert arg["--dtype"] == "float32" and arg["--host"] == "127.0.0.1" and s.url.endswith(arg["--port"])
    assert int(arg["--max-model-len"]) == p.real.max_model_len and int(arg["--max-num-seqs"]) == O.MAX_NUM_SEQS
    # the same token-slot budget in whole blocks of vLLM-CPU's multiple of 32, plus its null block
    block, blocks = int(arg["--block-size"]), int(arg["--num-gpu-blocks-override"])
    assert block == 32 and (blocks - 1) * block <= p.real.num_slots < blocks * block
    assert s.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and s.env["OMP_NUM_THREADS"] == "1"  # unpinned, as ours
    assert s.env["VLLM_CPU_KVCACHE_SPACE"] and vllm_cpu.environment(2)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "PYTHONPATH" not in s.env and s.startup_s >= 120
    other = vllm_cpu.server_command("py", "m", 1, served_model_name="x", max_model_len=8, num_slots=100,
                                    block_size=48, max_num_seqs=1, max_num_batched_tokens=8)
    assert other[other.index("--block-size") + 1] == "64"  # rounded up to a multiple of 32


def _found(system, which, rate, judged=True, search_requests=600):
    return {"system": system, "which": which, "sustainable_rate": rate, "resolution": 0.04, "bound_by": "capacity",
            "failed_at": rate * 1.04, "offline_rate": 2 * rate, "trend_se": 0.005 if judged else 0.03,
            "judged": judged, "search_requests": search_requests}


def agreeing_from_the_third_length(lengths, first):
    """A stand-in for ``capacity.sustainable_rate``: one probe, and an answer whose rate agrees with the one before
    from the third trace length on (``lengths``: the replays' trace lengths, as the test's replay records them)."""
    from pagedattn.repro.sim import capacity

    def fake_search(probe, lo, hi, threshold_s, resolution, **kw):
        probe(lo)
        rate = 4.0 if lengths[-1] > 2 * first else 4.0 * lengths[-1] / first
        return capacity.RateSearch(rate, rate * 1.01, 0.01, "capacity", rate, 0.01, 1)
    return fake_search


def test_a_search_follows_the_trace_length_rule_and_its_cap(monkeypatch):
    """``Params.search_requests`` and ``max_length_doublings``: a search runs on n requests and on 2n, doubling while
    the two rates disagree, up to the cap; past it the rate is not judged, with the reason. With no doubling (the
    default since issue 64) it runs on n alone and carries no verdict of the rule. The ratio's note names each
    length."""
    from pagedattn.repro.sim import capacity

    lengths = []

    def replay(rate, n):
        lengths.append(n)
        return pd.DataFrame()
    monkeypatch.setattr(capacity, "sustainable_rate", agreeing_from_the_third_length(lengths, 30))
    row = O.search(replay, 10.0, O.Params.make(True, search_requests=30, max_length_doublings=1), 0.05)
    assert lengths == [30, 60] and row["search_requests"] == 60 and not row["length_agreed"]
    assert "never agreed" in row["length_reason"]
    lengths.clear()
    row = O.search(replay, 10.0, O.Params.make(True, search_requests=30), 0.05)
    assert lengths == [30] and row["search_requests"] == 30 and row["length_agreed"] is None
    assert row["length_reason"] == ""
    lengths.clear()
    row = O.search(replay, 10.0, O.Params.make(True, search_requests=30, max_length_doublings=3), 0.05)
    assert lengths == [30, 60, 120, 240] and row["search_requests"] == 240 and row["length_agreed"]
    assert row["rate_at_half_length"] == 4.0
    sus = pd.DataFrame([_found("paged", "measured", 4.0, search_requests=60), _found("orca_oracle", "measured", 2.0,
                                                                                      search_requests=30)])
    cur = pd.DataFrame([{"system": "paged", "rate": 1.0, "nl_error_pct": 1.0}])
    note = {c.name: c for c in O.claims(cur, sus)}["online.rate_ratio.paged_vs_orca_oracle.measured"].note
    assert "ours searched on 60 requests, Orca (Oracle)'s on 30" in note


def test_a_search_starts_from_the_bracket_its_own_grid_gives():
    """``grid_bracket``: the highest passing grid rate and the lowest failing one above it, read from the measured
    or the predicted columns; none where the grid passes everywhere or nowhere. The search from it finds what the
    search from the offline throughput's bracket finds, within the resolution, in no more probes."""
    def point(rate, nl_m, up_m, nl_p, up_p):
        return {"system": "paged", "rate": rate, "nl_measured_s": nl_m, "keeps_up_measured": up_m,
                "throughput_measured": rate, "nl_predicted_s": nl_p, "keeps_up_predicted": up_p,
                "throughput_predicted": rate}
    grid = [point(1.0, 0.01, True, 0.01, True), point(2.0, 0.02, True, 0.2, True), point(3.0, 0.02, False, 0.3, True)]
    assert O.grid_bracket(grid, 0.1, "paged", "measured") == (2.0, 3.0)
    assert O.grid_bracket(grid, 0.1, "paged", "predicted") == (1.0, 2.0)
    assert O.grid_bracket(grid, 0.001, "paged", "measured") is None
    assert O.grid_bracket(grid, 1.0, "paged", "predicted") is None

    # the grid on the search's trace (150 requests, one length), where its bracket holds the answer
    p = O.Params.make(True, num_requests=150, search_requests=150, rate_resolution=0.05,
                      load_fractions=(0.4, 0.7, 1.0))
    cost = O.FittedStepTime(decode_s=2e-3, decode_per_seq_s=1e-4, prefill_per_token_s=1e-5)
    offline = len(p.trace(math.inf)) / float(O.predict(p.trace(math.inf), "paged", p, cost).finish_time.max())
    loads = {f * offline: O.Load.of(O.predict(p.trace(f * offline), "paged", p, cost)) for f in p.load_fractions}
    grid = [point(r, ld.normalized_latency_s, ld.keeps_up(), math.nan, False) for r, ld in loads.items()]
    bracket = O.grid_bracket(grid, 0.05, "paged", "measured")
    assert bracket is not None

    def replay(rate, n):
        return O.predict(p.trace(rate, n), "paged", p, cost)
    plain, from_grid = O.search(replay, offline, p, 0.05), O.search(replay, offline, p, 0.05, bracket)
    assert bracket[0] <= from_grid["sustainable_rate"] < from_grid["failed_at"] <= bracket[1]
    assert from_grid["probes"] <= plain["probes"]  # fewer on some traces; equal on the default of issue 50
    assert abs(from_grid["sustainable_rate"] / plain["sustainable_rate"] - 1) <= p.rate_resolution


def test_vllm_has_a_curve_and_a_grid_rate_but_no_prediction_and_no_ratio():
    rows = []
    for system in ("paged", "orca_oracle", O.VLLM):
        for rate, nl in ((1.0, 0.01), (2.0, 0.02), (3.0, 0.5)):
            pred = float("nan") if system == O.VLLM else nl * 1.1
            rows.append({"system": system, "rate": rate, "nl_measured_s": nl, "keeps_up_measured": True,
                         "throughput_measured": rate, "nl_predicted_s": pred, "keeps_up_predicted": system != O.VLLM,
                         "nl_error_pct": 10.0 if system != O.VLLM else float("nan")})
    cur = pd.DataFrame(rows)
    sus = pd.DataFrame([_found("paged", "measured", 4.0), _found("orca_oracle", "measured", 2.0, judged=False),
                        _found("paged", "predicted", 3.0), _found("orca_oracle", "predicted", 2.0),
                        O.grid_sustainable(cur[cur.system == O.VLLM], 0.1, O.VLLM)])
    cl = {c.name: c for c in O.claims(cur, sus)}
    v = cl[f"online.sustainable_rate.{O.VLLM}.measured"]
    assert v.ours == 2.0 and v.kind == "tracking" and "no ratio" in v.note and "grid" in v.note
    assert not any(O.VLLM in name for name in cl if "ratio" in name)
    assert "over 6 (system, rate) points" in cl["online.prediction_error_pct.median"].note
    m, p = cl["online.rate_ratio.paged_vs_orca_oracle.measured"], cl["online.rate_ratio.paged_vs_orca_oracle.predicted"]
    assert (m.ours, p.ours) == (2.0, 1.5) and "600 requests" in m.note
    assert "ratio resolution 8.2 %" in m.note and "offline throughput ratio 2.00" in m.note  # capacity.describe_ratio
    assert "NOT JUDGED" in m.note and "NOT JUDGED" not in p.note


FAKE_SERVER = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # as vLLM's engine core
print(child.pid, flush=True)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _stopped(pid: int) -> bool:
    """Gone, or a zombie waiting to be reaped (Linux's /proc)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_a_server_and_its_children_are_stopped_on_exit():
    """vLLM's server starts child processes (engine core, worker): leaving the context stops the whole group."""
    port = O._free_port()
    with O.Server([sys.executable, "-c", FAKE_SERVER, str(port)], dict(os.environ), port, startup_s=30) as s:
        s.log.seek(0)
        child = int(s.log.readline())
        assert not _stopped(child)  # alive while the server is
    deadline = time.monotonic() + 5
    while not _stopped(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _stopped(child)


def test_latency_gap_fits_a_per_request_delay_and_a_per_token_cost():
    """``latency_gap``: the fit that ``measure_server_cost`` and ``benchmarks/serve_overhead.py`` share recovers a
    known delay and per-token cost from two frames of the same requests (in another order in the second)."""
    from pagedattn.repro.experiments.online_serving import latency_gap

    out = np.array([3, 10, 25, 40, 7])
    b = pd.DataFrame({"request_id": list("abcde"), "arrival_time": [0.0, 0.1, 0.2, 0.3, 0.4],
                      "output_len": out})
    b["finish_time"] = b.arrival_time + 0.001 * out
    a = b.assign(finish_time=b.finish_time + 0.012 + 0.0005 * out).iloc[::-1]
    intercept, slope = latency_gap(a, b)
    assert intercept == pytest.approx(0.012, abs=1e-9) and slope == pytest.approx(0.0005, abs=1e-9)


def test_a_checkpoint_is_saved_once_under_a_name_its_bytes_decide(tmp_path):
    shape = O.Params().model
    model = tiny_opt(0, **shape)
    a, again = vllm_cpu.saved_checkpoint(model, tmp_path), vllm_cpu.saved_checkpoint(model, tmp_path)
    other = vllm_cpu.saved_checkpoint(tiny_opt(1, **shape), tmp_path)
    assert a == again != other
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({Path(a).name, Path(other).name})  # no leftovers
    loaded = OPTForCausalLM.from_pretrained(a)
    assert all(torch.equal(x, y) for x, y in zip(loaded.state_dict().values(), model.state_dict().values()))
