"""The scoreboard of issue 51 (``report.scoreboard``, the verdicts of ``results``): verdicts, strict verdicts,
reasons, row lengths, the GPU claims counted once, and the committed SUMMARY.md's shape."""
import json
import sys

import pytest

from pagedattn.repro.report import scoreboard
from pagedattn.repro.report.results import (CORNER, FAILS, HOLDS, NOT_MEASURED, RESULTS_DIR, Claim, difference_pct,
                                            measured_reason, printed_interval, verdict, verdict_table, verdict_text,
                                            write_summary)


def band(lo, hi):
    return {"min": lo, "max": hi, "over": "step-time constants"}


@pytest.mark.parametrize("value,interval", [(1.3, [1.25, 1.35]), (30.42, [30.415, 30.425]), ("2", [1.5, 2.5]),
                                            (22.0, [21.95, 22.05])])
def test_printed_interval_is_half_a_unit_of_the_last_printed_digit(value, interval):
    assert printed_interval(value) == pytest.approx(interval)


def test_a_failing_claim_whose_measured_value_passes_is_reproduced_at_our_value_only():
    # the band's low end leaves the accepted interval, the measured value does not
    b = {**band(1.17, 1.99), "outside": 3, "points": 13}
    c = Claim("r", "1.7-2.7", 1.93, "x", "", False, band=b, accept=[1.275, 3.375], strict=[1.7, 2.7])
    assert c.at_measured is True and verdict(c) == CORNER
    assert verdict_text(c) == "reproduced at our value, not across the assumptions (3 of 13 outside)"
    assert "low end 1.17" in measured_reason(c)
    # outside at the measured value: not reproduced, whatever the band
    c = Claim("r", 1.3, 1.697, "x", "", False, band=band(1.5, 1.8), accept=[0.975, 1.625],
              strict=printed_interval(1.3))
    assert verdict(c) == FAILS and "outside" in measured_reason(c)


@pytest.mark.parametrize("ours,paper,pct", [(96.5, 96.3, 0.2077), (2.09, (1.7, 2.7), 0.0), (1.5, (1.7, 2.7), -11.76),
                                            (3.0, (1.7, 2.7), 11.11), (0.706, (0.0, 0.2), 253.0), ([16, 32], [16], None),
                                            (0.5, "comparable", None), (None, 1.3, None)])
def test_difference_is_from_the_value_or_the_nearest_end_of_the_range(ours, paper, pct):
    d = difference_pct(Claim("r", paper, ours), paper)
    assert d == pytest.approx(pct, abs=0.01) if pct is not None else d is None


def test_not_measured_and_unjudged_claims_and_open_intervals():
    assert verdict(Claim("r", 2, None, note="not run")) == NOT_MEASURED
    assert verdict(Claim("r", 2, 2.1, holds=None)) == NOT_MEASURED  # measured but its rates did not agree
    c = Claim("p", 96.3, 97.0, "%", "ours >= 96", True, accept=[96, None])
    assert c.at_measured is True and verdict(c) == HOLDS and "the accepted >= 96" in measured_reason(c)
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
    assert any("…" in line for line in rows)


def test_every_registry_number_has_a_row_and_unjudged_ones_are_not_measured(tmp_path):
    from pagedattn.repro.paper import REGISTRY

    write_summary(tmp_path / "03_throughput", "03_throughput", "cpu", "m", False,
                  [Claim("rate_ratio.sharegpt.paged_vs_orca_oracle", "1.7-2.7", 2.0, "x", "", True,
                         accept=[1.275, 3.375])])
    rs = scoreboard.rows(scoreboard.summaries(tmp_path), tmp_path, tmp_path)
    assert [r.entry.paper_id for r in rs] == list(REGISTRY)
    got = {r.entry.paper_id: r.verdict for r in rs}
    assert got.pop("fig12.opt13b.sharegpt.vs_orca_oracle") == HOLDS and set(got.values()) == {NOT_MEASURED}
    tally = scoreboard.render_tally(rs)
    assert tally.startswith(f"**Of the paper's {len(REGISTRY)} numbers, 1 are reproduced,")
    assert "1 of the 1 with a numeric difference lie within 10 % of the paper" in tally


def test_gpu_check_claims_that_a_notebook_copies_are_counted_once_and_its_own_are_recorded(tmp_path):
    copied = Claim("paged_over_contiguous_latency.gpu", "1.2-1.26", 2.7, "x", "", False, accept=[None, 1.3])
    write_summary(tmp_path / "02_attention_kernel", "02_attention_kernel", "cpu", "m", False, [copied])
    write_summary(tmp_path / "gpu_check", "gpu_check", "cuda", "m", False,
                  [copied, Claim("engine_matches_hf_greedy.gpu.float32", None, 1.0, "", "", True, accept=[1, 1])])
    scored = scoreboard.scored_claims(scoreboard.summaries(tmp_path))
    assert [(n, c["name"]) for n, c in scored] == [("02_attention_kernel", "paged_over_contiguous_latency.gpu"),
                                                  ("gpu_check", "engine_matches_hf_greedy.gpu.float32")]
    assert scored[0][1]["paper_id"] == "fig18a.paged_over_contiguous" and scored[1][1]["kind"] == "tracking"


def test_verdict_table_has_the_paper_ours_the_difference_one_verdict_and_the_reason():
    t = verdict_table([Claim("r", "1.7-2.7", 1.43, "x", "", True, accept=[1.275, 3.375], strict=[1.7, 2.7],
                             reason="fewer slots at 175B", paper_id="fig12.opt175b.sharegpt.vs_orca_oracle")])
    assert list(t.columns) == ["paper number", "claim", "paper", "ours", "difference", "verdict", "reason"]
    assert t.iloc[0][["ours", "difference", "verdict", "reason"]].tolist() == \
        ["1.43 x", "-15.9 %", "reproduced", "fewer slots at 175B"]


def test_committed_summary_opens_with_the_tally_and_keeps_rows_short():
    md = (RESULTS_DIR / "SUMMARY.md").read_text()
    body = [line for line in md.splitlines()[3:] if line.strip()]
    assert body[0].startswith("**Of the paper's ") and "within 10 % of the paper" in body[0]
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
