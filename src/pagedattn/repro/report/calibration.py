"""A clock that travels (issue 64): a run's minutes stated in units of the machine's own speed at that hour.

Two 2-core VMs ran the same notebooks 2-3x apart, and one VM differs from itself between a quiet and a busy hour,
so an absolute time says little. ``make reproduce`` therefore times two fixed workloads before its first notebook
and after its last (``measure``), each repeated for at least ``SECONDS_EACH`` of wall time:

- **replay**: one fixed simulator replay (``benchmarks/sim_speed.py``'s ``online.paged``: 1,000 ShareGPT requests
  at 5 req/s, paged, OPT-13B on an A100-40GB), the work of most notebooks;
- **engine**: one fixed small workload of the real engine (the tiny OPT of ``pagedattn.model.tiny``, one torch
  thread, paged, ``ENGINE_REQUESTS`` greedy requests of ``ENGINE_PROMPT`` prompt and ``ENGINE_OUTPUT`` output
  tokens), the work of the notebooks that time engines.

**Both run the code of one pinned commit** (``PINNED_COMMIT``, the commit of the reference VM's full run), not this
tree's: a clock must not run faster when the code it times does. Until 2026-12-07 they ran this tree's code, so a
faster simulator or engine shrank the unit and inflated the normalised minutes of the very change that made them
faster (side by side on one VM that day: 6a7449b's replay 0.25 s against this tree's 0.20 s, its engine workload
0.090 s against 0.067 s). ``pinned_tree`` exports that commit's ``src`` once with ``git archive`` into
``.cache/calibration/`` and builds its compiled simulator there (as ``make fastsim`` does for this tree, about half a
minute, once per clone); a run's two measurements run the workloads in one subprocess with that tree on its path
(``Clock``, ``CHILD``), which sets up once.
Where the commit cannot be exported (a clone without its history) or compiled, ``measure`` records why and the run
carries no normalised minutes.

The *calibration unit* is the fastest replay plus the fastest engine workload, in wall seconds (the fastest of the
repeats is the one other processes disturbed least). A notebook's seconds divided by the mean unit before and after
the run are its time in units, which the same commit takes on any machine at any hour up to the notebook's own mix
of work; times ``REFERENCE_UNIT_S`` they are the minutes it would take on the reference VM (``REFERENCE_VM``, fixed
once in docs/REPRODUCING.md). ``normalised`` does that arithmetic; ``reproduce`` writes both into each ``run.json``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

from pagedattn.repro import REPO_ROOT

#: each workload repeats until this many wall seconds have passed (at least twice): a calibration of >= 2 s in all
SECONDS_EACH = 1.0
REPLAY_REQUESTS, ENGINE_REQUESTS, ENGINE_PROMPT, ENGINE_OUTPUT = 1000, 8, 64, 32
REPLAY = "sim_speed online.paged: 1,000 ShareGPT requests at 5 req/s, paged, OPT-13B/A100-40GB"
ENGINE = (f"tiny OPT (pagedattn.model.tiny), one torch thread, paged, {ENGINE_REQUESTS} greedy requests of "
          f"{ENGINE_PROMPT} + {ENGINE_OUTPUT} tokens")
#: the code both workloads run: the commit of the reference VM's full run (its replay is ``REFERENCE_REPLAY_S``)
PINNED_COMMIT = "6a7449bd35a3e144ed728de15448419a4a9f20ea"
PINNED_DIR = REPO_ROOT / ".cache" / "calibration" / PINNED_COMMIT[:12]
#: The reference VM (docs/REPRODUCING.md), fixed once on 2026-12-07: the developers' 2-core AMD EPYC (AVX-512 BF16)
#: VM of the committed full run of 6a7449b (33.6 minutes), on which the pinned replay took ``REFERENCE_REPLAY_S``
#: (its ``run.json``'s ``calibration_replay``: 0.151-0.161 s before each of its 14 notebooks, 0.154 before 03's,
#: compiled simulator). The engine workload was not run there: it is put at ``ENGINE_PER_REPLAY`` of the replay,
#: the median ratio of the two pinned workloads in eight calibrations (``measure``) on 2026-12-07 (0.34-0.42; engine
#: 0.075-0.110 s, replay 0.22-0.30 s), on a 2-core Intel Xeon (AVX-512, AMX) VM, not on the reference VM's AMD EPYC:
#: the engine's quarter of the unit is an estimate (a ratio of 0.30 or 0.45 there would move the unit by -6 or +5 %).
REFERENCE_VM = "cpu: AMD EPYC (AVX-512 BF16), 2 cores: the developers' VM of the full run of 6a7449b"
REFERENCE_REPLAY_S = 0.154
ENGINE_PER_REPLAY = 0.38
REFERENCE_UNIT_S = round(REFERENCE_REPLAY_S * (1 + ENGINE_PER_REPLAY), 3)
#: ``PAGEDATTN_CALIBRATION=0`` skips the calibration (``run.json`` then records ``null``): the test suite's fake
#: notebooks take seconds and need none.
ENV = "PAGEDATTN_CALIBRATION"

#: Run with the workloads' tree first on ``sys.path`` (``Clock``): its set-up (torch, the tiny OPT, the trace: about
#: 7 s on a slow 2-core VM, more than the measurement), then ``ready``, then for each line read on stdin ``{min_s}``
#: seconds of each workload, as one line of JSON on stdout. It uses only what the pinned commit and this tree both
#: have (``make_trace``, ``simulate``, ``tiny_opt``, ``LLMEngine``).
CHILD = """
import json, math, sys, time
import torch
from pagedattn.engine import LLMEngine
from pagedattn.model.tiny import tiny_opt
from pagedattn.repro.sim import fastsim
from pagedattn.repro.sim.simulator import simulate
from pagedattn.repro.workloads.traces import make_trace
from pagedattn.sequence import SamplingParams

torch.set_num_threads(1)
trace, model = make_trace("sharegpt", {replay_requests}, 5.0, seed=0), tiny_opt(0)

def replay():
    simulate(trace, "paged")

def engine():
    e = LLMEngine(model, None, "paged", num_slots=4096, block_size=16, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens={output}, ignore_eos=True)
    for i in range({requests}):
        e.add_request(str(i), [(7 * i + j) % 500 + 2 for j in range({prompt})], params)
    while e.has_unfinished_requests():
        e.step()

def fastest(fn, min_s):
    wall, cpu, runs, start = math.inf, math.inf, 0, time.perf_counter()
    while runs < 2 or time.perf_counter() - start < min_s:
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall, cpu, runs = min(wall, time.perf_counter() - w), min(cpu, time.process_time() - c), runs + 1
    return {{"wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "runs": runs}}

module, why = fastsim.status()
print("ready", flush=True)
for line in sys.stdin:  # one measurement per line: the set-up above is paid once per run
    replay(), engine()  # warm-up
    print(json.dumps({{"replay": fastest(replay, {min_s}), "engine": fastest(engine, {min_s}),
                      "simulator": "compiled" if module is not None else "interpreted (" + why + ")"}}), flush=True)
"""


class Unavailable(RuntimeError):
    """The pinned commit's tree cannot be exported or its simulator compiled here."""


def tree_env(tree: Path) -> dict:
    """The environment of a subprocess that runs ``tree``'s code (its ``src`` on ``PYTHONPATH``, one OpenMP thread):
    the calibration's child, and ``benchmarks/``' runs of a commit's tree."""
    return {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1"}


def export_commit(ref: str, into: Path) -> Path:
    """Commit ``ref``'s ``src`` under ``into`` (``git archive``: no work tree or worktree needed); ``Unavailable``
    where git cannot (a clone without that commit). ``benchmarks/sim_speed.py`` exports its baseline with it too."""
    got = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", ref, "src"], capture_output=True)
    if got.returncode != 0:
        raise Unavailable(f"git archive {ref[:7]} failed (a clone without that commit?): "
                          f"{got.stderr.decode(errors='replace').strip()[:200]}")
    with tarfile.open(fileobj=BytesIO(got.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def export_pinned(root: Path) -> Path:
    """The pinned commit's ``src`` under ``root`` (``export_commit``, once: an existing export is kept)."""
    if (root / "src" / "pagedattn").is_dir():
        return root
    print(f"calibration: exporting {PINNED_COMMIT[:7]}'s code into {root} and compiling its simulator (once, about a "
          "minute)", file=sys.stderr, flush=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=root.name + "."))
    try:
        export_commit(PINNED_COMMIT, tmp)
        tmp.rename(root)  # atomic: another run may have made it meanwhile
    except Unavailable:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def pinned_tree() -> Path:
    """The pinned commit's tree under ``PINNED_DIR`` (``export_pinned``) with its simulator compiled there (its own
    ``fastsim --if-stale``: built on first use); ``Unavailable`` saying why where git or the compiler cannot."""
    root = export_pinned(PINNED_DIR)
    built = subprocess.run([sys.executable, "-m", "pagedattn.repro.sim.fastsim", "--if-stale"], cwd=root,
                           env=tree_env(root), capture_output=True, text=True)
    if built.returncode != 0:
        raise Unavailable(f"the pinned commit's simulator did not compile: {built.stderr.strip()[-300:]}")
    return root


class Clock:
    """The calibration of one run: a child process (``CHILD``, the pinned commit's code: ``tree``, by default
    ``pinned_tree()``) that sets up once and measures both workloads, each for at least ``min_s`` seconds (default
    ``SECONDS_EACH``), each time ``measure`` is called: before a run's first notebook and after its last. Idle
    between the two, it waits on its stdin and takes no CPU. Until 2026-12-07 each measurement started a child of its
    own and paid the set-up twice (about 7 of each 10-11 s on a slow 2-core VM). A context manager: the child is
    stopped on exit. ``$PAGEDATTN_CALIBRATION`` = ``0``: no child, and ``measure`` gives ``None``."""

    def __init__(self, min_s: float | None = None, tree: Path | None = None) -> None:
        self.min_s = SECONDS_EACH if min_s is None else min_s
        self.tree, self.proc, self.log, self.failed = tree, None, None, None
        self.off = os.environ.get(ENV, "1") == "0"

    def __enter__(self) -> "Clock":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        self.tree = pinned_tree() if self.tree is None else self.tree
        code = CHILD.format(min_s=self.min_s, replay_requests=REPLAY_REQUESTS, requests=ENGINE_REQUESTS,
                            prompt=ENGINE_PROMPT, output=ENGINE_OUTPUT)
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=self.tree, env=tree_env(self.tree),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self._line()  # "ready"

    def _line(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.seek(0)
            err = self.log.read().decode(errors="replace").strip()
            raise Unavailable(f"the calibration workloads failed: {err[-300:]}")
        return line

    def workloads(self) -> dict:
        """One measurement of both workloads (the child started on first use): the child's JSON."""
        if self.proc is None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write("measure\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # the child has ended: ``_line`` says why
            pass
        return json.loads(self._line())

    def measure(self) -> dict | None:
        """One calibration: ``unit_s``, the fastest replay plus the fastest engine workload, with both workloads'
        times, the load average and ``seconds``, what it took (the child's set-up included the first time); ``None``
        where ``$PAGEDATTN_CALIBRATION`` is ``0``. Where the pinned code is unavailable or its simulator ran
        interpreted (the reference replay was compiled), ``{"unavailable": why}`` and no unit (and every later
        measurement says the same)."""
        if self.off:
            return None
        start = time.perf_counter()
        if self.failed is None:
            try:
                got = self.workloads()
            except Unavailable as e:
                self.failed = str(e)
                self.close()
        if self.failed is not None:
            return {"unavailable": self.failed, "code": PINNED_COMMIT}
        record = {"replay": {"workload": REPLAY, **got["replay"]}, "engine": {"workload": ENGINE, **got["engine"]},
                  "code": PINNED_COMMIT if self.tree == PINNED_DIR else str(self.tree),
                  "simulator": got["simulator"], "seconds": round(time.perf_counter() - start, 2),
                  "load_average": [round(x, 2) for x in os.getloadavg()]}
        if got["simulator"] != "compiled":
            return {**record,
                    "unavailable": f"the pinned simulator ran {got['simulator']}; the reference's was compiled"}
        return {**record, "unit_s": round(got["replay"]["wall_s"] + got["engine"]["wall_s"], 4)}

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # the child's loop ends at EOF
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            for f in (self.proc.stdout, self.proc.stdin):
                if f is not None and not f.closed:
                    f.close()
            self.log.close()
            self.proc, self.log = None, None


def measure(min_s: float | None = None, tree: Path | None = None) -> dict | None:
    """One calibration (``Clock.measure``) in a child of its own: both workloads of the pinned commit (``tree``:
    ``pinned_tree()``), each for at least ``min_s`` seconds (default ``SECONDS_EACH``)."""
    with Clock(min_s, tree) as clock:
        return clock.measure()


def normalised(seconds: float, before: dict | None, after: dict | None) -> dict | None:
    """``seconds`` in calibration units (over the mean unit of ``before`` and ``after``, either alone where the other
    is missing or has no unit) and as minutes on the reference VM; ``None`` with no calibration."""
    units = [c["unit_s"] for c in (before, after) if c and "unit_s" in c]
    if not units:
        return None
    unit = sum(units) / len(units)
    return {"unit_s": round(unit, 4), "units": round(seconds / unit, 1),
            "reference_vm_minutes": round(seconds / unit * REFERENCE_UNIT_S / 60, 2)}
