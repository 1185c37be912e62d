"""The ShareGPT experiments' rules and claims (issue 21): Fig. 2's memory-bound rate rule never averages over steps
that are not memory-bound, and the Fig. 17 claims judge the ratios against tolerances fixed in advance."""
import math

import pandas as pd

from pagedattn.repro.sim.capacity import RateSearch

from pagedattn.repro.experiments import chatbot, kv_waste
from pagedattn.repro.sim.simulator import ITERATION_LEVEL, simulate
from pagedattn.repro.workloads.traces import TraceRequest, make_trace, with_rate


def test_steady_state_drops_warm_up_and_drain():
    trace = [TraceRequest(f"r{i}", float(i), 40, 40) for i in range(20)]
    r = simulate(trace, "paged")
    ss = kv_waste.steady_state(r)  # SimResult.steady_window: a fifth of the arrivals is ramp-up
    assert ss.steps["time"].min() >= 4.0 and ss.steps["time"].max() < 19.0  # arrivals of request 4 and request 19
    assert len(ss.steps) < len(r.steps) and ss.requests is r.requests


def test_fig2_rate_rule_reports_none_when_memory_never_fills():
    params = kv_waste.Params.make(True, fig2_rate_grid=(0.05,))
    rate, table = kv_waste.fig2_rate(make_trace("sharegpt", 40, 1.0, seed=0), params, progress=False)
    assert rate is None and table["paged_memory_bound_pct"].tolist() == [0.0]


def test_fig2_rate_rule_takes_the_lowest_qualifying_rate():
    params = kv_waste.Params.make(True, fig2_rate_grid=(0.05, 100.0, 200.0), memory_bound_min_pct=50.0)
    rate, table = kv_waste.fig2_rate(make_trace("sharegpt", 120, 1.0, seed=0), params, progress=False)
    assert rate == 100.0 and list(table["rate"]) == [0.05, 100.0]  # stops at the first rate that qualifies


def _breakdowns(real_ts: float) -> pd.DataFrame:
    rows = []
    for trace, ts, rate in (("sharegpt", real_ts, 5.0), ("sharegpt_synthetic", 97.0, 3.0)):
        for s in ITERATION_LEVEL:
            rows.append({"trace": trace, "system": s, "rate": rate if not math.isnan(ts) else math.nan,
                         "token_states": ts if s == "paged" else 30.0, "reserved": 20.0, "internal": 20.0,
                         "external": 30.0, "memory_bound_steps_pct": 95.0})
    return pd.DataFrame(rows)


def _batches() -> pd.DataFrame:
    return pd.DataFrame([{"trace": t, "rate": 2.0, "system": s, "mean_batch": 10.0, "paper_mean_batch": 10.0,
                          "max_request_waste_slots": 15} for t in ("sharegpt", "sharegpt_synthetic") for s in ITERATION_LEVEL])


def test_fig2_claims_carry_the_synthetic_value_and_null_when_not_memory_bound():
    cl = {c.name: c for c in kv_waste.claims(_breakdowns(95.0), _batches(), 16)}
    paged = cl["token_states_pct.paged"]
    assert paged.ours == 95.0 and paged.holds is False and "synthetic trace: 97.0" in paged.note
    assert cl["token_states_pct.paged.synthetic"].holds is True
    assert "real trace: 95.0" in cl["token_states_pct.paged.synthetic"].note
    assert cl["max_request_waste_slots.paged"].holds is True
    real_nan = {c.name: c for c in kv_waste.claims(_breakdowns(math.nan), _batches(), 16)}
    c = real_nan["token_states_pct.paged"]
    assert c.ours is None and c.holds is None and "no memory-bound step" in c.note


def test_chatbot_claims_use_two_sided_bands():
    def sus(paged, oracle, mx):
        rates = {"orca_max": mx, "orca_pow2": oracle, "orca_oracle": oracle, "paged": paged}
        return pd.DataFrame([{"system": s, **RateSearch(r, 1.02 * r, 0.02, "latency", r, 0.1, 9).row()}
                             for s, r in rates.items()])

    cl = {c.name: c for c in chatbot.claims(sus(2.0, 1.0, 1.0))}
    assert cl["rate_ratio.chatbot.paged_vs_orca_oracle"].ours == 2.0
    assert all(c.holds for c in cl.values())
    cl = {c.name: c for c in chatbot.claims(sus(4.0, 1.0, 0.5))}  # too good and not alike: both fail
    assert cl["rate_ratio.chatbot.paged_vs_orca_oracle"].holds is False
    assert cl["rate_ratio.chatbot.orca_max_vs_orca_oracle"].holds is False
    assert "OPT" in cl["rate_ratio.chatbot.paged_vs_orca_max"].note
    assert "ratio resolution 4.0 %" in cl["rate_ratio.chatbot.paged_vs_orca_max"].note


def test_chatbot_trace_is_history_cut_to_1024():
    tr = with_rate(make_trace("sharegpt_chat", 500, 1.0, seed=0), 2.0)
    assert max(r.prompt_len for r in tr) == 1024 and max(r.output_len for r in tr) <= 1024
    assert sum(r.prompt_len for r in tr) / len(tr) > 400  # histories: far longer than single-turn prompts
