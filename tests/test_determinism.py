"""The same seed gives a byte-identical summary.json: two quick runs of notebook 01's experiment (the simulator, so
no claim rests on a timing), one of them in a fresh interpreter with another string-hash seed. Claims of kind
"tracking" (CPU timings) would be the only ones allowed to differ, and this experiment has none."""
import json
import os
import subprocess
import sys
from pathlib import Path

from pagedattn.repro.experiments import kv_waste

SMALL = dict(quick=True, progress=False, num_requests=80, sweep_block_sizes=(16,))


def summary(root: Path) -> bytes:
    """summary.json without its provenance: the files a run's process had imported, which differ between this
    test's process (every test module's imports) and a fresh interpreter, as they should."""
    doc = json.loads((root / kv_waste.EXPERIMENT / "summary.json").read_text())
    assert "src/pagedattn/repro/experiments/kv_waste.py" in doc.pop("provenance")["files"]
    return json.dumps(doc, indent=2).encode()


def test_same_seed_same_summary_bytes(tmp_path):
    kv_waste.run(results_dir=tmp_path / "a", **SMALL)
    code = f"from pagedattn.repro.experiments import kv_waste; kv_waste.run(results_dir={str(tmp_path / 'b')!r}, **{SMALL!r})"
    env = {**os.environ, "PYTHONHASHSEED": "12345",
           "PYTHONPATH": os.pathsep.join([str(Path(kv_waste.__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    assert summary(tmp_path / "a") == summary(tmp_path / "b")
    recorded = [c for c in json.loads(summary(tmp_path / "a"))["claims"] if c["kind"] == "tracking"]
    assert all(c["cross_check"] for c in recorded)  # only cross-checks of 03's numbers: nothing timing-based
    kv_waste.run(results_dir=tmp_path / "c", **{**SMALL, "seed": 1})  # and the seed matters
    assert summary(tmp_path / "c") != summary(tmp_path / "a")
