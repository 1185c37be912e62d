"""Where a notebook's time goes (issue 26): an experiment's ``run()`` with each of its steps timed.

Every function defined in the experiment's module (``pagedattn.repro.experiments.NAME``), and the sensitivity
band's ``sensitivity.sweep``, is timed in wall seconds where ``run`` calls it (not where those functions call each
other), and the totals are printed per function, largest first, beside the whole run's. Sweeps inside a step run on
``pagedattn.repro.sim.parallel``'s workers as in a notebook, so a step's seconds are wall time on all of them.

The run writes into a temporary folder, never over ``results/``; the band's cache goes to a temporary folder too
(``--cache`` keeps the repository's, ``.cache/sensitivity``, whose entries make a band's points free), so that by
default the steps cost what they cost on a clean clone. Notebooks that share cached searches (04 and 11 share Fig.
14's) then cost more here than in ``make reproduce``, which runs them in order on one cache.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/notebook_phases.py fig14_curves [--quick] [--jobs N] [--cache]
"""
from __future__ import annotations

import argparse
import collections
import functools
import importlib
import inspect
import os
import tempfile
import time


def timed_steps(module, extra: dict) -> collections.Counter:
    """Wrap every function of ``module`` and each ``extra`` ``{label: (owner, attribute)}`` so that a call made
    outside any other wrapped call adds its wall seconds to the returned counter, under its name."""
    seconds: collections.Counter = collections.Counter()
    depth = [0]

    def wrap(label: str, f):
        @functools.wraps(f)
        def g(*args, **kwargs):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    seconds[label] += time.perf_counter() - t
        return g

    for name, f in list(vars(module).items()):
        if inspect.isfunction(f) and f.__module__ == module.__name__ and name != "run":
            setattr(module, name, wrap(name, f))
    for label, (owner, attr) in extra.items():
        setattr(owner, attr, wrap(label, getattr(owner, attr)))
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", help="a module of pagedattn.repro.experiments: fig14_curves, scale, sharing, ...")
    ap.add_argument("--quick", action="store_true", help="the notebook's quick mode")
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (default: one per core)")
    ap.add_argument("--cache", action="store_true", help="use the repository's sensitivity cache")
    args = ap.parse_args()
    from pagedattn.repro.sim import parallel
    from pagedattn.repro.experiments import sensitivity

    parallel.configure(args.jobs)
    module = importlib.import_module(f"pagedattn.repro.experiments.{args.experiment}")
    seconds = timed_steps(module, {"sensitivity.sweep (bands)": (sensitivity, "sweep")})
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as cache:
        if not args.cache:
            os.environ["PAGEDATTN_SENSITIVITY_CACHE"] = cache
        t = time.perf_counter()
        module.run(quick=args.quick, results_dir=out, progress=False)
        total = time.perf_counter() - t
    for name, s in seconds.most_common():
        print(f"{s:8.1f} s  {100 * s / total:5.1f} %  {name}")
    print(f"{total:8.1f} s  100.0 %  run() in all (quick={args.quick}, jobs={parallel.num_jobs()})")


if __name__ == "__main__":
    main()
