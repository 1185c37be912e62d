"""The quick reproduction of this tree against a baseline commit's, side by side on one machine (issue 64).

Both run ``python -m pagedattn.repro.report.reproduce --quick`` into a temporary folder, each from its own tree (the
baseline checked out with ``git worktree add`` into a temporary folder, ``PYTHONPATH`` at its ``src``), one after
the other, each with an empty search cache (``PAGEDATTN_SENSITIVITY_CACHE``: as on a clean clone) and its own
compiled simulator (built first, untimed, as ``make reproduce`` builds it before the run). Each run is bracketed by
the calibration (``pagedattn.repro.report.calibration.measure``: the pinned commit's workloads, the same for both
trees), so that the two wall times can also be compared in calibration units where the machine's speed moved
between them. This tree's own run also times that calibration before its first notebook and after its last (the
baseline's does not), so ``ratio_notebooks_wall``, the notebooks' wall time that each run prints, compares the
same work; ``ratio`` is the commands' wall time. Prints the ratio this / baseline and
writes ``results/benchmarks/reproduce_time.json`` with both runs, the ratio, and the last full run's minutes from the
committed ``results/*/run.json``: as measured, and as minutes on the reference VM (``calibration.normalised`` where a
``run.json`` carries the run's calibration; else from its ``calibration_replay`` against the reference VM's replay).

    PYTHONPATH=src nice -n 5 python benchmarks/reproduce_time.py [--baseline 6dfe786] [--only 03 07 ...]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedattn.repro.report import calibration
from pagedattn.repro.report.results import REPO_ROOT, RESULTS_DIR, hardware_label, today

OUT = RESULTS_DIR / "benchmarks" / "reproduce_time.json"


def quick_run(tree: Path, only: list[str] | None) -> dict:
    """``tree``'s quick reproduction (its own ``src``, a fresh search cache and results folder): wall seconds, the
    notebooks' seconds from their ``run.json``, its exit code, the wall time it printed for its notebooks (without its
    own calibration, which the baseline does not have), and this tree's calibration before and after."""
    env = calibration.tree_env(tree)
    subprocess.run([sys.executable, "-m", "pagedattn.repro.sim.fastsim", "--if-stale"], cwd=tree, env=env,
                   check=False, capture_output=True)
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as cache:
        env["PAGEDATTN_SENSITIVITY_CACHE"] = cache
        clock = calibration.Clock()  # one child for both measurements, as ``reproduce`` runs its own
        before = clock.measure()
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pagedattn.repro.report.reproduce", "--quick", "--results-dir",
                               out] + (["--only", *only] if only else []), cwd=tree, env=env, capture_output=True,
                              text=True)
        wall = time.perf_counter() - t
        after = clock.measure()
        clock.close()
        notebooks = {p.parent.name: json.loads(p.read_text())["seconds"] for p in sorted(Path(out).glob("*/run.json"))}
    print(proc.stdout[-3000:], proc.stderr[-2000:] if proc.returncode else "", sep="\n", flush=True)
    said = re.search(r"(\d+) notebooks in (\d+) s of wall time", proc.stdout)
    notebooks_wall = int(said.group(2)) if said else None  # reproduce's own: its calibration left out
    return {"tree": str(tree), "seconds": round(wall, 1), "returncode": proc.returncode, "notebooks": notebooks,
            "notebooks_wall_s": notebooks_wall, "calibration": {"before": before, "after": after},
            "normalised": calibration.normalised(wall, before, after),
            "normalised_notebooks": calibration.normalised(notebooks_wall, before, after) if notebooks_wall else None}


def full_run_minutes(results_dir: Path = RESULTS_DIR) -> dict:
    """The committed full run (``results/*/run.json``): its minutes of wall time as recorded (the notebooks' sum: a
    full run takes them one at a time), and on the reference VM: from each ``run.json``'s ``normalised`` minutes
    where present, else (the runs before issue 64) its seconds scaled by the reference VM's replay
    (``calibration.REFERENCE_REPLAY_S``) over its ``calibration_replay``, the same replay."""
    runs = [json.loads(p.read_text()) for p in sorted(results_dir.glob("*/run.json"))]
    ref, how = 0.0, set()
    for r in runs:
        if r.get("normalised"):
            ref += r["normalised"]["reference_vm_minutes"]
            how.add("run.json's normalised minutes (calibration before and after the run)")
        elif r.get("calibration_replay"):
            ref += r["seconds"] / r["calibration_replay"]["wall_s"] * calibration.REFERENCE_REPLAY_S / 60
            how.add("seconds x reference replay / the notebook's calibration_replay (the replay alone)")
    return {"minutes": round(sum(r["seconds"] for r in runs) / 60, 1), "reference_vm_minutes": round(ref, 1),
            "normalised_by": sorted(how), "notebooks": {r["notebook"]: r["seconds"] for r in runs},
            "dates": sorted({r["date"] for r in runs}), "machines": sorted({r["machine"] for r in runs})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="6dfe786")
    ap.add_argument("--only", nargs="*", default=None, help="notebook prefixes (both runs take the same ones)")
    ap.add_argument("--note", default="", help="a sentence for the record (say, how loaded the machine was)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                          text=True).stdout.strip()
    base = Path(tempfile.mkdtemp(prefix="reproduce_time_"))
    subprocess.run(["git", "worktree", "add", "--detach", str(base), args.baseline], cwd=REPO_ROOT, check=True,
                   capture_output=True)
    try:
        for f in (REPO_ROOT / ".cache").glob("sharegpt-*.npz"):  # the tokenised lengths: both start with them
            (base / ".cache").mkdir(exist_ok=True)
            shutil.copy(f, base / ".cache" / f.name)
        this = quick_run(REPO_ROOT, args.only)
        baseline = quick_run(base, args.only)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO_ROOT, check=False)
    ratio = this["seconds"] / baseline["seconds"]
    units = (this["normalised"]["units"] / baseline["normalised"]["units"]
             if this["normalised"] and baseline["normalised"] else None)
    record = {"this": {"commit": head, **this}, "baseline": {"commit": args.baseline, **baseline},
              "ratio": round(ratio, 3), "ratio_in_calibration_units": None if units is None else round(units, 3),
              "ratio_notebooks_wall": round(this["notebooks_wall_s"] / baseline["notebooks_wall_s"], 3)
              if this["notebooks_wall_s"] and baseline["notebooks_wall_s"] else None,
              "only": args.only, "target_ratio": 0.5, "target_quick_reference_vm_minutes": 1.0,
              "full_run": full_run_minutes(), "target_full_reference_vm_minutes": 15.0,
              "machine": hardware_label("cpu"), "date": today(), "note": args.note,
              "load_average_end": [round(x, 2) for x in os.getloadavg()]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"quick run: this tree ({head}) {this['seconds']:.0f} s, {args.baseline} {baseline['seconds']:.0f} s: "
          f"ratio {ratio:.2f}" + (f" ({units:.2f} in calibration units)" if units else "") + f"; wrote {args.out}")


if __name__ == "__main__":
    main()
