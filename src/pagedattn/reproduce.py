"""Run every notebook headlessly with papermill into ``results/<notebook>/`` (``make reproduce``).

Each notebook has a ``parameters`` cell with at least ``quick`` (small parameters) and ``results_dir`` (the root
under which it writes ``<notebook name>/``). The executed copy is saved beside its CSV/PNG/summary.json, and
``results/SUMMARY.md`` is regenerated at the end.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pagedattn.results import REPO_ROOT, RESULTS_DIR, build_summary_md

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"


def kernel_name() -> str:
    """The venv's registered kernel when present (``make`` registers it), else the current interpreter's."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        if "pagedattn" in KernelSpecManager().find_kernel_specs():
            return "pagedattn"
    except Exception:  # pragma: no cover - jupyter_client is a papermill dependency
        pass
    return "python3"


def run_notebook(path: str | os.PathLike, quick: bool, results_dir: str | os.PathLike = RESULTS_DIR,
                 parameters: dict | None = None, timeout_s: int = 3600) -> Path:
    """Execute one notebook; return the executed copy's path (``<results_dir>/<name>/<name>.ipynb``)."""
    import papermill as pm

    path = Path(path)
    out_dir = Path(results_dir) / path.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / path.name
    params = {"quick": bool(quick), "results_dir": str(Path(results_dir).resolve())}
    params.update(parameters or {})
    env_src = str(REPO_ROOT / "src")
    os.environ["PYTHONPATH"] = env_src + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    pm.execute_notebook(str(path), str(out), parameters=params, kernel_name=kernel_name(), cwd=str(NOTEBOOKS_DIR),
                        progress_bar=False, execution_timeout=timeout_s, log_output=False)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small parameters (CI-sized)")
    ap.add_argument("--only", nargs="*", help="notebook name prefixes to run, e.g. 01 03")
    ap.add_argument("--results-dir", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    notebooks = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
    if args.only:
        notebooks = [nb for nb in notebooks if any(nb.name.startswith(p) for p in args.only)]
    failed = []
    for nb in notebooks:
        t0 = time.perf_counter()
        print(f"[reproduce] {nb.name} (quick={args.quick}) ...", flush=True)
        try:
            out = run_notebook(nb, args.quick, args.results_dir)
            print(f"[reproduce]   -> {out.relative_to(REPO_ROOT) if out.is_relative_to(REPO_ROOT) else out} "
                  f"in {time.perf_counter() - t0:.0f} s", flush=True)
        except Exception as e:  # keep going: one broken notebook must not hide the others' results
            print(f"[reproduce]   FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            failed.append(nb.name)
    print(f"[reproduce] wrote {build_summary_md(args.results_dir)}")
    if failed:
        print(f"[reproduce] failed notebooks: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
