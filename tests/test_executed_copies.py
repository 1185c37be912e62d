"""Issue 51, item 6: executed notebooks (results/<NN>/*.ipynb) show no progress bar, no warning, no local path."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "results"
_BAR = re.compile(r"\d+%\|")            # tqdm's "  0%|" bar
_PATH = re.compile(r"(/work/|/home/|\.venv)")


def noisy_outputs(nb: dict) -> list[str]:
    """Every progress bar, warning on stderr and absolute/venv path in a notebook's outputs, as 'cell N: what'."""
    found = []
    for i, cell in enumerate(nb.get("cells", [])):
        for out in cell.get("outputs", []):
            texts = [out.get("text", "")] if out.get("output_type") == "stream" else []
            texts += [v for k, v in out.get("data", {}).items() if k.startswith("text/")]
            text = "".join("".join(t) if isinstance(t, list) else t for t in texts)
            if _BAR.search(text) or "\r" in text:
                found.append(f"cell {i}: progress bar")
            if out.get("name") == "stderr" and ("Warning" in text or "deprecated" in text):
                found.append(f"cell {i}: warning")
            if _PATH.search(text):
                found.append(f"cell {i}: local path")
    return found


def _nb(text: str, name: str = "stdout") -> dict:
    return {"cells": [{"cell_type": "code", "outputs": [{"output_type": "stream", "name": name, "text": text}]}]}


def test_scanner_on_synthetic_notebooks():
    assert noisy_outputs(_nb("throughput 2.7x\n")) == []
    assert noisy_outputs(_nb("sim vllm:   0%|          | 0/12 [00:00<?, ?it/s]", "stderr")) == ["cell 0: progress bar"]
    assert noisy_outputs(_nb("x.py:3: PerformanceWarning: slow\n", "stderr")) == ["cell 0: warning"]
    assert noisy_outputs(_nb("loaded from /work/main/.venv/lib\n")) == ["cell 0: local path"]


def test_committed_executed_copies_are_quiet():
    bad = {str(p.relative_to(RESULTS)): f for p in sorted(RESULTS.glob("[0-9][0-9]_*/*.ipynb"))
           if (f := noisy_outputs(json.loads(p.read_text())))}
    assert not bad, bad


def test_no_executed_copy_records_an_absolute_path():
    """Issue 61: papermill's metadata names the notebook and its copy from the repository root (``reproduce.relink``)."""
    bad = {}
    for p in sorted(RESULTS.glob("[0-9][0-9]_*/*.ipynb")):
        meta = json.loads(p.read_text())["metadata"]
        found = [m.group(0) for m in re.finditer(r'"(/[^"]*)"', json.dumps(meta))]
        if found:
            bad[str(p.relative_to(RESULTS))] = found
    assert not bad, bad


def test_relink_makes_papermill_paths_relative_to_the_repository(tmp_path, monkeypatch):
    import nbformat

    from pagedattn.repro.report import reproduce
    monkeypatch.setattr(reproduce, "REPO_ROOT", tmp_path)
    nb = nbformat.v4.new_notebook()
    nb.metadata["papermill"] = {"input_path": str(tmp_path / "notebooks" / "01_a.ipynb"),
                                "output_path": str(tmp_path / "results" / "01_a" / "01_a.ipynb")}
    executed = tmp_path / "results" / "01_a" / "01_a.ipynb"
    executed.parent.mkdir(parents=True)
    nbformat.write(nb, str(executed))
    reproduce.relink(executed, tmp_path / "notebooks")
    assert nbformat.read(str(executed), as_version=4).metadata["papermill"] == {
        "input_path": "notebooks/01_a.ipynb", "output_path": "results/01_a/01_a.ipynb"}


def test_no_progress_bar_when_stderr_is_not_a_terminal(monkeypatch):
    """The one helper every tqdm bar in src/ asks: off when stderr is not a tty (a papermill kernel, a pipe)."""
    import io
    import sys

    from pagedattn.repro.progress import interactive
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert interactive() is False
