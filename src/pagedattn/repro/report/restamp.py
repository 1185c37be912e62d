"""Carry results over a change that provably leaves them as they were, and say so (issue 49).

A result is stale when a file it imported changed since its run (``results.stale_reason``). A refactor changes files
without changing what they compute; the golden digests prove that for every simulator replay (value for value), the
engine-against-simulator test for every step the engine plans, and the engine-against-Hugging-Face tests for its
tokens. ``python -m pagedattn.repro.report.restamp --reason "..." [NAME ...]``:

1. runs those checks (``CHECKS``) on this tree, and stops, restamping nothing, unless they pass;
2. for each named result (default: every stale one) updates its ``provenance`` to the files now: the recorded files'
   hashes, less the deleted ones, plus the ``pagedattn`` modules the recorded ones import now (a fresh process
   imports them; so a module that a refactor split off is watched from now on);
3. appends a ``restamps`` entry to its ``provenance``: the date, the commit, the reason, the files that had changed
   and the checks that passed. ``results/SUMMARY.md`` prints every restamp beside the result.

The numbers are not rerun: the entry says so. A change that may move a result (a timing, a tolerance, a model's
output) is no refactor: rerun that notebook instead (``python -m pagedattn.repro.report.reproduce --only NAME``).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from pagedattn.repro.report.results import REPO_ROOT, RESULTS_DIR, _relative, changed_files, source_hash, today

#: the tests whose passing shows that a change leaves replays, scheduling decisions and tokens as they were
CHECKS = ("tests/test_sim_golden.py", "tests/test_engine_vs_sim.py", "tests/test_engine.py",
          "tests/test_beam_search.py")


def run_checks(root: Path = REPO_ROOT) -> bool:
    """``pytest`` over ``CHECKS`` in ``root``; True when they pass."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CHECKS], cwd=root)
    return done.returncode == 0


def imported_now(modules: list[str], root: Path = REPO_ROOT) -> list[Path]:
    """The ``pagedattn`` source files that importing ``modules`` loads now, in a fresh process."""
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}:\n    importlib.import_module(m)\n"
            "print(json.dumps(sorted(getattr(m, '__file__', None) or '' for m in list(sys.modules.values()))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    package = (root / "src" / "pagedattn").resolve()
    return [Path(f) for f in json.loads(out.strip().splitlines()[-1]) if f and Path(f).resolve().is_relative_to(package)]


def _module(rel: str) -> str | None:
    """``src/pagedattn/a/b.py`` -> ``pagedattn.a.b`` (None for a file that is not a module of the package)."""
    if not (rel.startswith("src/pagedattn/") and rel.endswith(".py")):
        return None
    name = rel.removeprefix("src/").removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def restamp(path: Path, reason: str, commit: str, root: Path = REPO_ROOT) -> list[str]:
    """Restamp one ``summary.json`` (see the module docstring); returns the files that had changed (none: left
    as it was)."""
    doc = json.loads(path.read_text())
    changed = changed_files(doc, root) or []
    if not changed:
        return []
    recorded = doc["provenance"]["files"]
    kept = [rel for rel in recorded if (root / rel).exists()]
    modules = [m for m in (_module(rel) for rel in kept) if m]
    files = {rel: source_hash(root / rel) for rel in kept}
    files.update({_relative(p, root): source_hash(p) for p in imported_now(modules, root)})
    doc["provenance"]["files"] = dict(sorted(files.items()))
    doc["provenance"].setdefault("restamps", []).append(
        {"date": today(), "commit": commit, "reason": reason, "changed": changed, "checks": list(CHECKS),
         "rerun": False})
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="result folders under results/ (default: every stale one)")
    ap.add_argument("--reason", required=True, help="why the change leaves the results as they were")
    args = ap.parse_args(argv)
    if not run_checks():
        print("restamp: the checks failed; nothing restamped", file=sys.stderr)
        return 1
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip()
    paths = [RESULTS_DIR / n / "summary.json" for n in args.names] or sorted(RESULTS_DIR.glob("*/summary.json"))
    for path in paths:
        changed = restamp(path, args.reason, commit)
        if changed:
            print(f"restamped {path.parent.name}: {len(changed)} changed files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
