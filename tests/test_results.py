"""The results pipeline (``results.py``, ``reproduce.py``): summary.json and SUMMARY.md in DESIGN.md's convention,
and ``reproduce.main`` with a faked notebook runner (no notebook is executed here)."""
import json
import math
from pathlib import Path

import pytest

from pagedattn import reproduce
from pagedattn.results import (KINDS, QUICK_RESULTS_DIR, RESULTS_DIR, STALE_FILE, Claim, build_summary_md,
                               write_summary)

FIELDS = {"name", "paper", "ours", "unit", "tolerance", "holds", "note", "kind", "band"}


def check_convention(doc: dict) -> None:
    """A summary.json in DESIGN.md's results convention (used by tests/test_notebooks.py too)."""
    assert {"experiment", "hardware", "model", "date", "quick", "claims"} <= set(doc) and doc["claims"]
    for c in doc["claims"]:
        assert set(c) == FIELDS, c["name"]
        assert c["kind"] in KINDS, c["name"]
        assert c["band"] is None or {"min", "max", "over"} <= set(c["band"]), c["name"]
        if c["ours"] is None:  # not measured: it cannot hold, and the note says why
            assert c["holds"] is None and c["note"], c["name"]
        assert c["holds"] in (True, False, None), c["name"]


def test_claim_fields_round_trip_and_render(tmp_path):
    claims = [Claim("token_states_pct.paged", 96.3, 97.25, "%", "ours >= 96", True,
                    band={"min": 91.0, "max": 98.5, "over": "step-time constants"}),
              Claim("rate_ratio.x", "1.7-2.7", None, "x", ">= 1.7", None, "the run was too short"),
              Claim("gain.nan", 2.0, float("nan"), "x", "", None, "NaN in, null out"),
              Claim("max_request_waste_slots.paged", "< 16", 15, "slots", "< 16", True, kind="invariant"),
              Claim("cpu_seconds", None, 1.5, "s", "not judged", None, kind="tracking")]
    write_summary(tmp_path / "01_x", "01_x", "cpu", "m", False, claims)
    doc = json.loads((tmp_path / "01_x" / "summary.json").read_text())
    check_convention(doc)
    assert doc["claims"][0]["band"] == {"min": 91.0, "max": 98.5, "over": "step-time constants"}
    assert doc["claims"][2]["ours"] is None  # NaN is not valid JSON: it becomes null
    md = build_summary_md(tmp_path).read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in md.splitlines() if line.startswith("| `")}
    assert "97.25 [91 .. 98.5 over step-time constants]" in rows["token_states_pct.paged"]
    assert rows["rate_ratio.x"].split("|")[3].strip() == "not measured"
    assert rows["gain.nan"].split("|")[3].strip() == "not measured"
    # invariants and tracking are listed apart from the reproduction claims, in that order
    sections = [md.index(h) for h in ("Reproduction claims", "Invariants", "Tracking")]
    assert sections == sorted(sections)
    assert sections[0] < md.index("rate_ratio.x") < sections[1] < md.index("max_request_waste") < sections[2] \
        < md.index("cpu_seconds")


def test_nan_rendered_from_a_hand_written_summary(tmp_path):
    (tmp_path / "09_y").mkdir()
    (tmp_path / "09_y" / "summary.json").write_text(json.dumps({
        "experiment": "09_y", "hardware": "h", "model": "m", "date": "d", "quick": True,
        "claims": [{"name": "a", "paper": 1, "ours": math.nan, "holds": None}]}))  # json writes NaN
    row = next(line for line in build_summary_md(tmp_path).read_text().splitlines() if line.startswith("| `a`"))
    assert row.split("|")[3].strip() == "not measured"


@pytest.mark.parametrize("bad,match", [(dict(kind="reproductive"), "kind must be one of"),
                                       (dict(band={"min": 1, "max": 2}), "missing \\['over'\\]")])
def test_bad_claims_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        Claim("x", 1, 1, **bad)


@pytest.fixture
def fake_notebooks(tmp_path, monkeypatch):
    """Three fake notebooks; the runner writes a summary.json for each, except 02_b, which fails."""
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    for name in ("01_a", "02_b", "03_c"):
        (nbs / f"{name}.ipynb").write_text("{}")
    monkeypatch.setattr(reproduce, "NOTEBOOKS_DIR", nbs)
    ran = []

    def fake_run(path, quick, results_dir, parameters=None, timeout_s=None):
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
    md = (out / "SUMMARY.md").read_text()
    assert "## 02_b (STALE)" in md and "cell 7 raised KeyError" in md and "from an earlier run" in md
    assert "## 01_a\n" in md and "## 03_c\n" in md  # the others are not marked
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
    monkeypatch.setattr(reproduce, "run_notebook", lambda path, quick, results_dir, **kw: ran.append(
        (Path(path).stem, quick, Path(results_dir))) or Path(results_dir))
    assert reproduce.main(["--quick", "--only", "01"]) == 0
    assert ran == [("01_a", True, QUICK_RESULTS_DIR)]
    assert QUICK_RESULTS_DIR.parent == RESULTS_DIR
    ignored = Path(__file__).resolve().parents[1] / ".gitignore"
    assert "/results/quick/" in ignored.read_text().split()
