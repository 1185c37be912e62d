"""Notebook 12's measurement (``experiments.kv_waste_running``): Fig. 2's breakdown read from running engines' cache
tensors accounts for the whole KV budget, system by system."""
import pytest


@pytest.mark.slow
def test_fig2_running_engines_accounts_for_the_whole_budget():
    from pagedattn.repro.experiments import kv_waste_running as k

    p = k.Params.make(True)
    p.num_requests = 10
    df = k.measure(p, progress=False)
    assert set(df.system) == set(k.COMPARED)
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
