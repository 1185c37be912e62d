"""Every notebook runs headlessly (papermill) in quick mode and writes its results and a summary.json in DESIGN.md's
convention, with the claim names DESIGN.md promises (stable, so that a reader can track them over time)."""
import json
from pathlib import Path

import pytest
from test_results import check_convention

from pagedattn.repro.report.reproduce import NOTEBOOKS_DIR, run_notebook
from pagedattn.repro.report.scoreboard import build_summary_md

NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))

# DESIGN.md, "Results convention": the stable claim names of each notebook (02's is suffixed by the hardware)
STABLE_CLAIMS = {
    "01": [f"{m}.{s}" for m in ("token_states_pct", "mean_batch") for s in ("orca_max", "orca_pow2", "orca_oracle",
                                                                             "paged")],
    "02": ["paged_over_contiguous_latency."],
    "03": ["rate_ratio.sharegpt.paged_vs_orca_oracle", "rate_ratio.sharegpt.paged_vs_orca_max",
           "throughput_ratio.paged_vs_hf_generate", "throughput_ratio.paged_vs_hf_continuous_batching"],
    "04": [f"saving_pct.{w}.{k}{i}" for w in ("alpaca", "sharegpt") for k in ("parallel_n", "beam_w")
           for i in (2, 4, 6)] + ["gain_over_orca_oracle.n1", "gain_over_orca_oracle.beam_w6"],
    "05": ["best_block_sizes.sharegpt", "best_block_sizes.alpaca"],
    "06": ["recompute_over_swap_latency.block16", "recompute_over_swap_latency.block64"],
    "07": [f"{m}.{s}" for m in ("prefix_speedup", "prefix_hit_rate") for s in ("one_shot", "five_shot")],
    "08": ["trace_mean.sharegpt.input", "trace_mean.sharegpt.output", "trace_log_corr.sharegpt"],
    "09": [f"rate_ratio.chatbot.{s}" for s in ("paged_vs_orca_oracle", "paged_vs_orca_pow2", "paged_vs_orca_max",
                                                "orca_max_vs_orca_oracle")],
    "10": ["table1.param_gb.", "table1.slots_from_paper_kv.", "table1.kv_gb_at_utilisation."],
    "11": ["gain_at_fixed_latency.n1", "gain_grows_with_n.parallel", "gain_at_fixed_latency.beam_w6",
           "gain_grows_with_width.beam", "beam_model.saving_pct.alpaca.beam_w6"],
    "12": [f"token_states_pct_running.{s}" for s in ("paged", "hf_dynamic", "hf_static", "hf_continuous")],
    "13": ["online.prediction_error_pct.median", "online.rate_ratio.paged_vs_orca_oracle.measured",
           "online.rate_ratio.paged_vs_orca_oracle.predicted"],
}


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_quick_mode(path: Path, tmp_path: Path):
    out = run_notebook(path, quick=True, results_dir=tmp_path)
    assert out.exists()
    doc = json.loads((tmp_path / path.stem / "summary.json").read_text())
    check_convention(doc)
    assert doc["quick"] is True and doc["hardware"] and doc["model"]
    names = [c["name"] for c in doc["claims"]]
    for stable in STABLE_CLAIMS.get(path.stem[:2], []):
        assert any(n == stable or (stable.endswith(".") and n.startswith(stable)) for n in names), stable
    assert list((tmp_path / path.stem).glob("*.png")), "a result notebook saves its figures"
    shown = [c for c in json.loads(out.read_text())["cells"] if c.get("outputs")]
    assert "verdicts" in shown[0]["metadata"].get("tags", []), "the page opens with its verdicts (issue 61)"
    build_summary_md(tmp_path)
    assert doc["experiment"] in (tmp_path / "DETAILS.md").read_text()


def test_source_notebooks_hold_no_outputs():
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            assert not cell.get("outputs"), f"{path.name} holds cell outputs; keep sources clean"
        assert any("parameters" in c.get("metadata", {}).get("tags", []) for c in nb["cells"]), path.name


def test_every_result_notebook_has_stable_claims_listed():
    assert {p.stem[:2] for p in NOTEBOOKS} - {"00"} == set(STABLE_CLAIMS)
