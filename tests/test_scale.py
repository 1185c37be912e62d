"""Notebook 10's experiment (``experiments.scale``): Table 1 from the models' configs, each setup's tensor-parallel
cost model, the rate claims (two-sided on ShareGPT, tracking elsewhere) and the knee grid of Fig. 12's curves."""
import pandas as pd


def test_table1_from_configs_matches_the_papers_setups():
    from pagedattn.repro.experiments import scale

    t = scale.table1().set_index("model")
    assert t.loc["OPT-13B", "kv_bytes_per_token"] == 800 * 1024  # §3: 800 KB per token
    assert t.loc["OPT-13B", "slots_from_paper_kv"] == 15728  # 12 GiB / 800 KiB
    assert 12.8 < t.loc["OPT-13B", "params_b"] < 12.9 and 174 < t.loc["OPT-175B", "params_b"] < 175.5
    claims = scale.table1_claims(scale.table1())
    assert {c.name.split(".")[1] for c in claims} == {"param_gb", "slots_from_paper_kv", "kv_gb_at_utilisation"}
    assert all(c.kind == ("reproduction" if ".kv_gb_at_utilisation." in c.name else "invariant")
               and isinstance(c.holds, bool) for c in claims)  # the paper's GB / bytes per token: by construction


def test_cost_model_of_each_setup_is_tensor_parallel_over_its_gpus():
    from pagedattn.repro.experiments import scale

    assert [scale.cost_model(m).tp_size for m in scale.MODELS] == [1, 4, 8]
    assert scale.cost_model("OPT-175B").hbm_bytes_per_s > scale.cost_model("OPT-66B").hbm_bytes_per_s


def test_rate_claims_are_two_sided_on_sharegpt_and_tracking_elsewhere():
    from pagedattn.repro.experiments import scale

    from pagedattn.repro.sim.capacity import RateSearch

    rows = [{"model": "OPT-66B", "trace": w, "system": s,
             **RateSearch(r, 1.02 * r, 0.02, "capacity", r, 0.1, 9, offline_rate=1.1 * r).row()}
            for w in ("sharegpt", "alpaca")
            for s, r in (("paged", 10.0), ("orca_oracle", 1.0), ("orca_max", 4.0), ("ft", 2.0))]
    got = {c.name: c for c in scale.rate_claims(pd.DataFrame(rows))}
    assert got["rate_ratio.OPT-66B.sharegpt.paged_vs_orca_oracle"].holds is False  # 10x: above 2.7 x 1.25
    assert got["rate_ratio.OPT-66B.sharegpt.paged_vs_orca_max"].holds is True  # 2.5x: within 2.025-10
    assert got["rate_ratio.OPT-66B.alpaca.paged_vs_orca_oracle"].kind == "tracking"
    note = got["rate_ratio.OPT-66B.sharegpt.paged_vs_orca_max"].note
    assert "ratio resolution 4.0 %" in note and "offline throughput ratio 2.50" in note
    assert "NVLink all-reduce constants assumed" in note  # OPT-66B: 4 GPUs, a tensor-parallel step


def test_knee_grid_extends_each_curve_until_it_passes_the_knee():
    from pagedattn.repro.experiments import scale

    latency = {0.5: 0.1, 1.0: 0.2, 1.25: 0.35, 1.5625: 0.41}
    got = scale.knee_grid((0.5, 1.0), lambda f: latency[round(f, 4)], 16.0)
    assert got == [(0.5, 0.1), (1.0, 0.2), (1.25, 0.35), (1.5625, 0.41)]  # stops once above 2 x 0.2 s/token
    got = scale.knee_grid((0.5, 1.0), lambda f: 0.1, 2.0)
    assert [f for f, _ in got] == [0.5, 1.0, 1.25, 1.5625, 1.953125]  # never rises: stops at the grid's end
    got = scale.knee_grid((0.5, 1.0), lambda f: 1.0, 16.0)
    assert [f for f, _ in got] == [0.5, 1.0]  # already past the knee
