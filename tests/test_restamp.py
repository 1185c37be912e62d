"""``pagedattn.repro.report.restamp``: a result carried over a refactor is fresh again, says so, and watches the modules
its recorded ones import now."""
import json

from pagedattn.repro.report import restamp
from pagedattn.repro.report.results import stale_reason
from pagedattn.repro.report.scoreboard import render_details_md


def test_restamp_updates_hashes_adds_imported_modules_and_records_why(tmp_path, monkeypatch):
    root = tmp_path
    pkg = root / "src" / "pagedattn"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("X = 1\n")
    (root / "requirements.txt").write_text("torch\n")
    monkeypatch.syspath_prepend(str(root / "src"))
    doc = {"experiment": "01_x", "hardware": "cpu", "model": "m", "date": "2026-12-01", "quick": False,
           "claims": [], "provenance": {"files": {"src/pagedattn/a.py": "0" * 16, "requirements.txt": "1" * 16,
                                                  "src/pagedattn/gone.py": "2" * 16}}}
    out = root / "results" / "01_x"
    out.mkdir(parents=True)
    path = out / "summary.json"
    path.write_text(json.dumps(doc))
    (pkg / "a.py").write_text("from pagedattn import b\nX = 1\n")  # a refactor splits b off a
    (pkg / "b.py").write_text("Y = 2\n")
    monkeypatch.setattr(restamp, "imported_now", lambda modules, root: [pkg / "a.py", pkg / "b.py"])
    assert stale_reason(doc, root).startswith("changed since the run")
    changed = restamp.restamp(path, "a refactor", "abc1234", root)
    assert changed == ["requirements.txt", "src/pagedattn/a.py", "src/pagedattn/gone.py (deleted)"]
    new = json.loads(path.read_text())
    assert stale_reason(new, root) is None
    assert sorted(new["provenance"]["files"]) == ["requirements.txt", "src/pagedattn/a.py", "src/pagedattn/b.py"]
    entry, = new["provenance"]["restamps"]
    assert entry["reason"] == "a refactor" and entry["commit"] == "abc1234" and not entry["rerun"]
    assert entry["changed"] == changed and entry["checks"] == list(restamp.CHECKS)
    assert "restamped" in render_details_md(root / "results", root) and "not rerun: a refactor" in \
        render_details_md(root / "results", root)
    assert restamp.restamp(path, "again", "def", root) == []  # fresh: left as it was
    (pkg / "b.py").write_text("Y = 3\n")  # the split-off module is watched now
    assert stale_reason(json.loads(path.read_text()), root) == "changed since the run: src/pagedattn/b.py"


def test_imported_now_sees_a_module_that_is_imported_by_a_recorded_one():
    files = restamp.imported_now(["pagedattn.engine"])
    assert any(f.name == "core.py" for f in files) and any(f.name == "systems.py" for f in files)
