"""The scoreboard of issue 51 (``report.scoreboard``, the verdicts of ``results``): verdicts, strict verdicts,
reasons, row lengths, the GPU claims counted once, and the committed SUMMARY.md's shape."""
import json
import sys

import pytest

from pagedattn.repro.report import scoreboard
from pagedattn.repro.report.results import (CORNER, FAILS, HOLDS, NOT_MEASURED, RESULTS_DIR, Claim, measured_reason,
                                            printed_interval, strict_verdict, verdict, verdict_table, write_summary)


def band(lo, hi):
    return {"min": lo, "max": hi, "over": "step-time constants"}


@pytest.mark.parametrize("value,interval", [(1.3, [1.25, 1.35]), (30.42, [30.415, 30.425]), ("2", [1.5, 2.5]),
                                            (22.0, [21.95, 22.05])])
def test_printed_interval_is_half_a_unit_of_the_last_printed_digit(value, interval):
    assert printed_interval(value) == pytest.approx(interval)


def test_a_failing_claim_whose_measured_value_passes_fails_only_at_a_band_corner():
    # the band's low end leaves the accepted interval, the measured value does not
    c = Claim("r", "1.7-2.7", 1.93, "x", "", False, band=band(1.17, 1.99), accept=[1.275, 3.375], strict=[1.7, 2.7])
    assert c.at_measured is True and verdict(c) == CORNER and strict_verdict(c) == HOLDS
    assert "low end 1.17" in measured_reason(c)
    # outside at the measured value: a plain failure, whatever the band
    c = Claim("r", 1.3, 1.697, "x", "", False, band=band(1.5, 1.8), accept=[0.975, 1.625],
              strict=printed_interval(1.3))
    assert verdict(c) == FAILS and strict_verdict(c) == FAILS and "outside" in measured_reason(c)


def test_a_claim_that_holds_only_through_the_widening_fails_strictly():
    c = Claim("r", "1.7-2.7", 1.43, "x", "", True, accept=[1.275, 3.375], strict=[1.7, 2.7])
    assert verdict(c) == HOLDS and strict_verdict(c) == FAILS


def test_not_measured_and_unjudged_claims_and_open_intervals():
    assert verdict(Claim("r", 2, None, note="not run")) == NOT_MEASURED
    assert verdict(Claim("r", 2, 2.1, holds=None)) == NOT_MEASURED  # measured but its rates did not agree
    assert strict_verdict(Claim("r", 2, None)) == "-"
    c = Claim("p", 96.3, 97.0, "%", "ours >= 96", True, accept=[96, None])
    assert c.at_measured is True and "the accepted >= 96" in measured_reason(c)
    with pytest.raises(ValueError, match="accept must be"):
        Claim("bad", 1, 1, accept=[1, 2, 3])


def test_reasons_written_by_the_experiment_win_and_the_rest_are_filled(tmp_path):
    write_summary(tmp_path / "01_x", "01_x", "cpu", "m", False,
                  [Claim("a", 1.0, 1.1, holds=True, accept=[0.75, 1.25], reason="the blocks fit"),
                   Claim("b", 1.0, 2.0, holds=False, accept=[0.75, 1.25])])
    a, b = json.loads((tmp_path / "01_x" / "summary.json").read_text())["claims"]
    assert a["reason"] == "the blocks fit" and b["reason"] == "2 outside the accepted 0.75-1.25"
    assert scoreboard.missing_reasons(tmp_path) == []


def test_no_row_is_over_300_characters_and_a_long_reason_is_cut_with_an_ellipsis(tmp_path):
    write_summary(tmp_path / "03_throughput", "03_throughput", "cpu", "m", False,
                  [Claim("rate_ratio.sharegpt.paged_vs_orca_oracle", "1.7-2.7", 1.5, "x", "", False,
                         accept=[1.275, 3.375], reason="why " * 200)])
    md = scoreboard.render_summary_md(tmp_path)
    rows = [line for line in md.splitlines() if line.startswith("|")]
    assert rows and max(map(len, rows)) <= scoreboard.MAX_ROW
    assert any(line.endswith("… |") for line in rows)


def test_gpu_check_claims_that_a_notebook_copies_are_counted_once(tmp_path):
    copied = Claim("paged_over_contiguous_latency.gpu", "1.2-1.26", 2.7, "x", "", False, accept=[None, 1.3])
    write_summary(tmp_path / "02_attention_kernel", "02_attention_kernel", "cpu", "m", False, [copied])
    write_summary(tmp_path / "gpu_check", "gpu_check", "cuda", "m", False,
                  [copied, Claim("engine_matches_hf_greedy.gpu.float32", None, 1.0, "", "", True, accept=[1, 1])])
    scored = scoreboard.scored_claims(scoreboard.summaries(tmp_path))
    assert [(n, c["name"]) for n, c in scored] == [("02_attention_kernel", "paged_over_contiguous_latency.gpu"),
                                                  ("gpu_check", "engine_matches_hf_greedy.gpu.float32")]


def test_verdict_table_has_both_verdicts_and_the_reason():
    t = verdict_table([Claim("r", "1.7-2.7", 1.43, "x", "", True, accept=[1.275, 3.375], strict=[1.7, 2.7],
                             reason="fewer slots at 175B")])
    assert list(t.columns) == ["claim", "paper", "ours", "tolerance", "band", "verdict", "strict", "reason"]
    assert t.iloc[0][["ours", "tolerance", "verdict", "strict", "reason"]].tolist() == \
        ["1.43 x", "1.275-3.375", "holds", "fails", "fewer slots at 175B"]


def test_committed_summary_opens_with_the_tallies_and_keeps_rows_short():
    md = (RESULTS_DIR / "SUMMARY.md").read_text()
    body = [line for line in md.splitlines()[3:] if line.strip()]
    assert body[0].startswith("**") and "reproduction claims:" in body[0]
    assert max(len(line) for line in md.splitlines() if line.startswith("|")) <= scoreboard.MAX_ROW


def test_committed_claims_carry_their_reasons():
    """Every claim of a notebook's summary.json has a reason (the GPU run's gpu_check/summary.json predates the
    field: its reasons are derived when the scoreboard renders it)."""
    missing = [m for m in scoreboard.missing_reasons() if not m.startswith(f"{scoreboard.GPU_CHECK}/")]
    assert not missing, f"claims without a reason (rerun their notebooks): {missing[:5]}"


def test_progress_bars_show_in_a_persons_jupyter_but_not_under_reproduce(monkeypatch):
    from pagedattn.repro import progress

    monkeypatch.setitem(sys.modules, "ipykernel", object())
    monkeypatch.delenv(progress.NOTEBOOK_ENV, raising=False)
    assert progress.interactive() is True
    monkeypatch.setenv(progress.NOTEBOOK_ENV, "notebooks/01_kv_memory_waste.ipynb")
    assert progress.interactive() is False


def test_executed_copies_keep_their_relative_links(tmp_path):
    import nbformat

    from pagedattn.repro.report.reproduce import relink

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("the [band](../docs/GLOSSARY.md#band), [paper](https://arxiv.org/abs/2309.06180)"),
        nbformat.v4.new_code_cell("Markdown(...)", outputs=[nbformat.v4.new_output(
            "display_data", data={"text/markdown": "a [steady window](../docs/GLOSSARY.md#steady-window)"})])])
    out = tmp_path / "results" / "01_x" / "01_x.ipynb"
    out.parent.mkdir(parents=True)
    nbformat.write(nb, out)
    relink(out, tmp_path / "notebooks")
    got = nbformat.read(out, as_version=4)
    assert got.cells[0].source == ("the [band](../../docs/GLOSSARY.md#band), "
                                   "[paper](https://arxiv.org/abs/2309.06180)")
    assert got.cells[1].outputs[0].data["text/markdown"] == "a [steady window](../../docs/GLOSSARY.md#steady-window)"
