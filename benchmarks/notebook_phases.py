"""Where a notebook's time goes (issues 26 and 64): an experiment's ``run()`` with each of its steps timed, and
every simulator replay and rate search counted.

Every function defined in the experiment's module (``pagedattn.repro.experiments.NAME``), and the sensitivity
band's ``sensitivity.sweep``, is timed in wall seconds where ``run`` calls it (not where those functions call each
other), and the totals are printed per function, largest first, beside the whole run's. With ``--jobs 1`` (the
quick run's own setting, one job per notebook) every replay runs in this process, so each step also gets its
simulator replays and simulated requests (``sim.simulate`` calls and the requests of their traces), and each rate
search (``capacity.sustainable_rate``) is logged: its trace length (the trace-length rule's n, 2n, ...), probes,
replays, simulated requests and seconds, and whether it is a knee search. With more jobs, the replays in the
workers are not counted (their seconds still are).

The run writes into a temporary folder, never over ``results/``; the band's cache goes to a temporary folder too
(``--cache`` keeps the repository's, ``.cache/``), so that by default the steps cost what they cost on a clean
clone. Notebooks that share cached searches (04 and 11 share Fig. 14's) then cost more here than in ``make
reproduce``, which runs them in order on one cache. ``--json FILE`` adds the profile to FILE (a dict by
experiment and mode), which ``results/benchmarks/reproduce_profile.json`` is made of.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/notebook_phases.py fig14_curves [--quick] [--jobs N] [--cache]
"""
from __future__ import annotations

import argparse
import collections
import functools
import importlib
import inspect
import json
import os
import tempfile
import time
from pathlib import Path


def timed_steps(module, extra: dict, counts: dict) -> collections.Counter:
    """Wrap every function of ``module`` and each ``extra`` ``{label: (owner, attribute)}`` so that a call made
    outside any other wrapped call adds its wall seconds to the returned counter, under its name, and the replays
    and simulated requests counted meanwhile (``counts``) to ``counts[label]``."""
    seconds: collections.Counter = collections.Counter()
    depth = [0]

    def wrap(label: str, f):
        @functools.wraps(f)
        def g(*args, **kwargs):
            depth[0] += 1
            t, before = time.perf_counter(), dict(counts["all"])
            try:
                return f(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    seconds[label] += time.perf_counter() - t
                    step = counts.setdefault(label, collections.Counter())
                    step.update({k: counts["all"][k] - before.get(k, 0) for k in counts["all"]})
        return g

    for name, f in list(vars(module).items()):
        if inspect.isfunction(f) and f.__module__ == module.__name__ and name != "run":
            setattr(module, name, wrap(name, f))
    for label, (owner, attr) in extra.items():
        setattr(owner, attr, wrap(label, getattr(owner, attr)))
    return seconds


def count_replays(counts: dict, searches: list) -> None:
    """Count every ``sim.simulate`` call and its requests in ``counts["all"]``, and log every rate search in
    ``searches``; before the experiment modules import them by name."""
    from pagedattn.repro.sim import capacity, simulator

    counts["all"] = collections.Counter()
    simulate = simulator.simulate

    @functools.wraps(simulate)
    def counted(trace, *args, **kwargs):
        counts["all"].update(replays=1, sim_requests=len(trace))
        return simulate(trace, *args, **kwargs)

    simulator.simulate = counted
    search = capacity.sustainable_rate

    @functools.wraps(search)
    def logged(replay, lo, hi, threshold_s=capacity.NL_THRESHOLD_S, *args, **kwargs):
        lengths = []

        def probe(rate):
            df = replay(rate)
            lengths.append(len(df))
            return df
        t, before = time.perf_counter(), dict(counts["all"])
        found = search(probe, lo, hi, threshold_s, *args, **kwargs)
        searches.append({"requests": max(lengths, default=0), "probes": found.probes,
                         "replays": counts["all"]["replays"] - before.get("replays", 0),
                         "sim_requests": counts["all"]["sim_requests"] - before.get("sim_requests", 0),
                         "seconds": round(time.perf_counter() - t, 2), "threshold_s": threshold_s,
                         "rate": found.rate, "bound_by": found.bound_by})
        return found

    capacity.sustainable_rate = logged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", help="a module of pagedattn.repro.experiments: fig14_curves, scale, sharing, ...")
    ap.add_argument("--quick", action="store_true", help="the notebook's quick mode")
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (default: one per core)")
    ap.add_argument("--cache", action="store_true", help="use the repository's cache (.cache/)")
    ap.add_argument("--json", default=None, help="add this profile to a JSON file")
    args = ap.parse_args()
    counts: dict = {}
    searches: list = []
    count_replays(counts, searches)
    from pagedattn.repro.sim import parallel
    from pagedattn.repro.experiments import sensitivity

    parallel.configure(args.jobs)
    module = importlib.import_module(f"pagedattn.repro.experiments.{args.experiment}")
    seconds = timed_steps(module, {"sensitivity.sweep (bands)": (sensitivity, "sweep")}, counts)
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as cache:
        if not args.cache:
            os.environ["PAGEDATTN_SENSITIVITY_CACHE"] = cache
        t, cpu = time.perf_counter(), time.process_time()
        module.run(quick=args.quick, results_dir=out, progress=False)
        total, cpu = time.perf_counter() - t, time.process_time() - cpu
    steps = []
    for name, s in seconds.most_common():
        c = counts.get(name, {})
        steps.append({"step": name, "seconds": round(s, 2), "replays": c.get("replays", 0),
                      "sim_requests": c.get("sim_requests", 0)})
        print(f"{s:8.1f} s  {100 * s / total:5.1f} %  {c.get('replays', 0):6d} replays "
              f"{c.get('sim_requests', 0):9d} requests  {name}")
    print(f"{total:8.1f} s  100.0 %  {counts['all']['replays']:6d} replays {counts['all']['sim_requests']:9d} "
          f"requests  run() in all (quick={args.quick}, jobs={parallel.num_jobs()}, {len(searches)} searches)")
    for s in sorted(searches, key=lambda s: -s["seconds"])[:8]:
        print(f"    search on {s['requests']} requests: {s['probes']} probes, {s['replays']} replays, "
              f"{s['sim_requests']} requests, {s['seconds']} s")
    if args.json:
        path = Path(args.json)
        record = json.loads(path.read_text()) if path.exists() else {}
        record.setdefault(args.experiment, {})["quick" if args.quick else "full"] = {
            "seconds": round(total, 1), "cpu_s": round(cpu, 1), "jobs": parallel.num_jobs(),
            "replays": counts["all"]["replays"], "sim_requests": counts["all"]["sim_requests"], "steps": steps,
            "searches": searches, "load_average": [round(x, 2) for x in os.getloadavg()]}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, sort_keys=True, default=str) + "\n")


if __name__ == "__main__":
    main()
