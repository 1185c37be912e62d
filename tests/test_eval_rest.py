"""Issue 16: the tensor-parallel step time, Table 1 from configs, Fig. 14's gain claims, Fig. 2 on running engines."""
from dataclasses import replace

import pandas as pd
import pytest

from pagedattn.sim import CostModel


# ------------------------------------------------------------------------------ tensor-parallel step time (sim.py)
def test_one_gpu_has_no_allreduce_and_ignores_its_constants():
    base = CostModel()
    other = replace(base, allreduce_bytes_per_s=1.0, allreduce_latency_s=1.0, hidden_size=1)
    assert base.allreduce_time(4096) == 0.0
    for cm in (base, other):
        assert cm.decode_time(30, 9000) == base.decode_time(30, 9000)
        assert cm.prefill_time(2048) == base.prefill_time(2048)


def test_tensor_parallel_splits_bytes_and_adds_one_allreduce_per_layer():
    one = CostModel(step_overhead_s=0.0)
    free = replace(one, tp_size=4, allreduce_latency_s=0.0, allreduce_bytes_per_s=float("inf"))
    assert free.decode_time(8, 4000) == pytest.approx(one.decode_time(8, 4000) / 4)  # memory-bound: 1/4 the bytes
    assert free.prefill_time(4096) == pytest.approx(one.prefill_time(4096) / 4)  # compute-bound: 1/4 the FLOPs
    tp = replace(free, allreduce_latency_s=1e-5, allreduce_bytes_per_s=1e11)
    ring = 2 * 3 / 4 * 8 * tp.hidden_size * 2 / 1e11  # ring all-reduce of 8 tokens' activations over 4 GPUs
    assert tp.allreduce_time(8) == pytest.approx(tp.num_layers * (1e-5 + ring))
    assert tp.decode_time(8, 4000) == pytest.approx(free.decode_time(8, 4000) + tp.allreduce_time(8))


# ------------------------------------------------------------------------------------------------- Table 1
def test_table1_from_configs_matches_the_papers_setups():
    from pagedattn.experiments import scale

    t = scale.table1().set_index("model")
    assert t.loc["OPT-13B", "kv_bytes_per_token"] == 800 * 1024  # §3: 800 KB per token
    assert t.loc["OPT-13B", "slots_from_paper_kv"] == 15728  # 12 GiB / 800 KiB
    assert 12.8 < t.loc["OPT-13B", "params_b"] < 12.9 and 174 < t.loc["OPT-175B", "params_b"] < 175.5
    claims = scale.table1_claims(scale.table1())
    assert {c.name.split(".")[1] for c in claims} == {"param_gb", "slots_from_paper_kv", "kv_gb_at_utilisation"}
    assert all(c.kind == "reproduction" and isinstance(c.holds, bool) for c in claims)


def test_cost_model_of_each_setup_is_tensor_parallel_over_its_gpus():
    from pagedattn.experiments import scale

    assert [scale.cost_model(m).tp_size for m in scale.MODELS] == [1, 4, 8]
    assert scale.cost_model("OPT-175B").hbm_bytes_per_s > scale.cost_model("OPT-66B").hbm_bytes_per_s


def test_rate_claims_are_two_sided_on_sharegpt_and_tracking_elsewhere():
    from pagedattn.experiments import scale

    rows = [{"model": "OPT-66B", "trace": w, "system": s, "sustainable_rate": r}
            for w in ("sharegpt", "alpaca")
            for s, r in (("paged", 10.0), ("orca_oracle", 1.0), ("orca_max", 4.0), ("ft", 2.0))]
    got = {c.name: c for c in scale.rate_claims(pd.DataFrame(rows))}
    assert got["rate_ratio.OPT-66B.sharegpt.paged_vs_orca_oracle"].holds is False  # 10x: above 2.7 x 1.25
    assert got["rate_ratio.OPT-66B.sharegpt.paged_vs_orca_max"].holds is True  # 2.5x: within 2.025-10
    assert got["rate_ratio.OPT-66B.alpaca.paged_vs_orca_oracle"].kind == "tracking"


# --------------------------------------------------------------------------------------------------- Fig. 14
def test_fig14_gain_claims():
    from pagedattn.experiments import fig14_curves

    def gains(values, beams=None):
        rows = [{"method": "parallel", "width": n, "preemption": "swap", "gain": g} for n, g in values.items()]
        rows += [{"method": "beam", "width": k, "preemption": "swap", "gain": g} for k, g in (beams or {}).items()]
        return pd.DataFrame(rows)

    got = {c.name: c for c in fig14_curves.claims(gains({1: 1.2, 2: 1.5, 4: 1.4, 6: 2.0}))}
    assert got["gain_at_fixed_latency.n1"].holds is True
    assert got["gain_grows_with_n.parallel"].holds is False  # 1.5 -> 1.4 falls
    assert got["gain_at_fixed_latency.beam_w6"].ours is None and "gain_grows_with_width.beam" not in got
    got = {c.name: c for c in fig14_curves.claims(gains({1: 2.0, 6: 3.0}))}
    assert got["gain_at_fixed_latency.n1"].holds is False and got["gain_grows_with_n.parallel"].holds is True
    # beam width 6 within 2.3x +- 25 % (1.725-2.875); the trend runs from n = 1 through the beam widths
    got = {c.name: c for c in fig14_curves.claims(gains({1: 1.3}, {2: 1.5, 4: 1.9, 6: 2.8}))}
    assert got["gain_at_fixed_latency.beam_w6"].holds is True and got["gain_grows_with_width.beam"].holds is True
    assert got["gain_grows_with_width.beam"].ours == [1.3, 1.5, 1.9, 2.8]
    assert got["gain_at_fixed_latency.beam_w2"].kind == "tracking"
    got = {c.name: c for c in fig14_curves.claims(gains({1: 1.3}, {2: 1.5, 4: 1.4, 6: 2.9}))}
    assert got["gain_at_fixed_latency.beam_w6"].holds is False and got["gain_grows_with_width.beam"].holds is False
    savings = pd.DataFrame([{"width": 6, "rate": 30.0, "distinct_parents": 4.52, "saving_pct": 60.2,
                             "paper_saving_pct": 55.16}])
    got = {c.name: c for c in fig14_curves.claims(gains({1: 1.3}), savings)}
    assert got["beam_model.saving_pct.alpaca.beam_w6"].holds is False  # 5.04 points off


def test_knee_grid_extends_each_curve_until_it_passes_the_knee():
    from pagedattn.experiments import scale

    latency = {0.5: 0.1, 1.0: 0.2, 1.25: 0.35, 1.5625: 0.41}
    got = scale.knee_grid((0.5, 1.0), lambda f: latency[round(f, 4)], 16.0)
    assert got == [(0.5, 0.1), (1.0, 0.2), (1.25, 0.35), (1.5625, 0.41)]  # stops once above 2 x 0.2 s/token
    got = scale.knee_grid((0.5, 1.0), lambda f: 0.1, 2.0)
    assert [f for f, _ in got] == [0.5, 1.0, 1.25, 1.5625, 1.953125]  # never rises: stops at the grid's end
    got = scale.knee_grid((0.5, 1.0), lambda f: 1.0, 16.0)
    assert [f for f, _ in got] == [0.5, 1.0]  # already past the knee


# ------------------------------------------------------------------------------------- Fig. 2, running engines
@pytest.mark.slow
def test_fig2_running_engines_accounts_for_the_whole_budget():
    from pagedattn.experiments import kv_waste_running as k

    p = k.Params.make(True)
    p.num_requests = 10
    df = k.measure(p, progress=False)
    assert set(df.system) == set(k.SYSTEMS)
    kinds = df[list(k.KINDS)]
    assert (kinds.sum(axis=1) - df.budget_bytes).abs().max() < 1e-6 * df.budget_bytes.max()
    assert (kinds >= -1e-9).all().all()
    static = df[df.system == "hf_static"]
    per_slot = static.budget_bytes.iloc[0] / p.real.num_slots
    # a static cache holds every row's max length from the first step, a dynamic one grows
    assert static.allocated_bytes.max() <= p.batch_size * p.real.max_model_len * per_slot + 1e-6
    assert static.allocated_bytes.iloc[0] == static.allocated_bytes.max()
    dyn = df[df.system == "hf_dynamic"]
    assert dyn.allocated_bytes.iloc[1] > dyn.allocated_bytes.iloc[0]
    paged = df[df.system == "paged"]
    assert (paged.token_states <= paged.held_bytes).all() and (paged.allocated_bytes == paged.budget_bytes).all()
