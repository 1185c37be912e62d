"""Issue 30, part 4: checks that hold by construction are built as invariants, not reproductions, by the functions
that make them (small frames in, no committed result read), and the scoreboard counts invariants apart."""
import pandas as pd

from pagedattn.repro.report.results import Claim

SYSTEMS = ("orca_max", "orca_pow2", "orca_oracle", "paged")


def kinds(claims) -> dict[str, str]:
    return {c.name: c.kind for c in claims}


def test_orca_max_mean_batch_is_an_invariant_in_notebook_01():
    from pagedattn.repro.experiments import kv_waste

    breakdowns = pd.DataFrame([{"trace": t, "system": s, "token_states": 50.0, "reserved": 20.0, "internal": 10.0,
                                "external": 20.0, "rate": 2.0,
                                "memory_bound_steps_pct": 95.0, "max_request_waste_slots": 3}
                               for t in kv_waste.SHAREGPT_TRACES for s in SYSTEMS])
    batches = pd.DataFrame([{"trace": t, "system": s, "rate": 2.0, "mean_batch": 7.0, "paper_mean_batch": 7.0,
                             "max_request_waste_slots": 3}
                            for t in ("sharegpt", "sharegpt_synthetic", "alpaca") for s in SYSTEMS])
    k = kinds(kv_waste.claims(breakdowns, batches, 16))
    for name in ("mean_batch.orca_max", "mean_batch.orca_max.synthetic", "mean_batch_alpaca.orca_max"):
        assert k[name] == "invariant", name
    for s in ("orca_pow2", "orca_oracle", "paged"):
        assert k[f"mean_batch.{s}"] == k[f"mean_batch_alpaca.{s}"] == "reproduction"
    assert k["token_states_pct.orca_max"] == "reproduction"
    # issue 61: the rest of each Orca bar of Fig. 2 is judged too; the paper splits vLLM's only into states and waste
    assert {k[f"{part}_pct.{s}"] for part in ("reserved", "internal", "external") for s in SYSTEMS[:3]} == \
        {"reproduction"}
    assert "reserved_pct.paged" not in k


def test_orca_max_mean_batch_is_an_invariant_in_notebook_03():
    from pagedattn.repro.experiments import throughput

    online = pd.DataFrame([{"trace": w, "rate": r, "system": s, "mean_batch": 7.0}
                           for w, r in (("sharegpt", 2.0), ("alpaca", 30.0)) for s in SYSTEMS])
    k = kinds(throughput.mean_batch_claims(online))
    assert k["mean_batch.sharegpt.orca_max"] == k["mean_batch.alpaca.orca_max"] == "invariant"
    assert {k[f"mean_batch.{w}.{s}"] for w in ("sharegpt", "alpaca") for s in SYSTEMS[1:]} == {"reproduction"}


def test_synthetic_trace_means_are_invariants_and_the_real_ones_are_judged():
    from pagedattn.repro.experiments import trace_lengths

    stats = pd.DataFrame([{"trace": t, "input_mean": 160.0, "output_mean": 340.0, "num_requests": 100,
                           "log_corr": 0.0} for t in trace_lengths.TRACES])
    k = kinds(trace_lengths.claims(stats))
    assert k["trace_mean.sharegpt.input.synthetic"] == k["trace_mean.sharegpt.output.synthetic"] == "invariant"
    assert k["trace_mean.sharegpt.input"] == "reproduction"  # issue 61: Fig. 11's means are numbers of the paper
    assert k["trace_log_corr.sharegpt"] == "tracking"  # the paper reports no correlation
    short = stats.assign(input_mean=100.0)  # 38 % below the paper's 161.31: outside 25 %, with the reason
    c = {c.name: c for c in trace_lengths.claims(short)}["trace_mean.sharegpt.input"]
    assert c.holds is False and "not published" in c.reason


def test_table1_slots_from_the_papers_kv_are_invariants():
    from pagedattn.repro.experiments import scale

    k = kinds(scale.table1_claims(scale.table1()))
    invariant = ("table1.slots_from_paper_kv.", "table1.param_gb.")  # issue 51: a parameter count is arithmetic
    assert {v for n, v in k.items() if n.startswith(invariant)} == {"invariant"}
    assert {v for n, v in k.items() if not n.startswith(invariant)} == {"reproduction"}


def test_automatic_prefix_speedup_is_an_invariant():
    from pagedattn.repro.experiments import shared_prefix as sp

    systems = ("orca_oracle", "paged_user", "paged_auto")
    sim = pd.DataFrame([{"shot": shot, "system": s, "speedup_vs_orca_oracle": 1.5, "hit_rate": 0.9,
                         "ideal_hit_rate": 0.9} for shot in sp.SHOTS for s in systems])
    ratios = pd.DataFrame([{"shot": shot, "threshold_s": t, "system": s, "speedup_vs_orca_oracle": 1.5,
                            "at_upper_bound": False, "resolution": 0.02, "bound_by": "latency", "failed_at": 2.0,
                            "offline_rate": 3.0}
                           for shot in sp.SHOTS for t in sp.NL_THRESHOLDS_S for s in systems])
    k = kinds(sp.claims(sim, None, ratios))
    assert {k[f"prefix_speedup_auto.{shot}"] for shot in sp.SHOTS} == {"invariant"}
    assert {k[f"prefix_speedup.{shot}"] for shot in sp.SHOTS} == {"reproduction"}


def test_tour_arithmetic_claims_are_built_as_invariants():
    from pagedattn.repro.experiments import worked_examples as we

    claims = we.kv_sizes()[1] + [we.forty_tokens()["claim"], we.copy_on_write()["claim"]]
    assert len(claims) >= 7 and {c.kind for c in claims} == {"invariant"}


def test_scoreboard_counts_invariants_and_tracking_apart():
    from pagedattn.repro.report.results import FAILS, HOLDS, INVARIANT, RECORDED, verdict

    cs = [Claim("a", 1, 1, "", "equal", True, kind="invariant").__dict__,
          Claim("b", 2, 3, "x", "", False, accept=[1.5, 2.5], paper_id="fig17.vs_orca_oracle").__dict__,
          Claim("c", None, 3, "s", "", None, kind="tracking").__dict__,
          Claim("d", 800, 800, "KB", "equal", True, kind="invariant", paper_id="s3.kv_per_token.opt13b").__dict__]
    # an invariant that checks a paper number is reproduced by construction; one that checks none is an invariant
    assert [verdict(c) for c in cs] == [INVARIANT, FAILS, RECORDED, HOLDS]
