"""Every notebook runs headlessly (papermill) in quick mode and writes its results and summary.json."""
import json
from pathlib import Path

import pytest

from pagedattn.reproduce import NOTEBOOKS_DIR, run_notebook
from pagedattn.results import build_summary_md

NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_quick_mode(path: Path, tmp_path: Path):
    out = run_notebook(path, quick=True, results_dir=tmp_path)
    assert out.exists()
    summary = tmp_path / path.stem / "summary.json"
    if summary.exists():  # result notebooks write one; a tour may not
        doc = json.loads(summary.read_text())
        assert doc["quick"] is True and doc["claims"] and doc["hardware"] and doc["model"]
        assert list((tmp_path / path.stem).glob("*.png")), "a result notebook saves its figures"
        assert doc["experiment"] in build_summary_md(tmp_path).read_text()


def test_source_notebooks_hold_no_outputs():
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            assert not cell.get("outputs"), f"{path.name} holds cell outputs; keep sources clean"
        assert any("parameters" in c.get("metadata", {}).get("tags", []) for c in nb["cells"]), path.name
