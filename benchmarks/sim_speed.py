"""How fast paper-scale replays run (issue 26): this tree's simulator against another commit's, side by side.

The replays (``--kinds``, default all):
- ``online.paged`` and ``online.orca_oracle``: the replay the issue measured, 1,000 real ShareGPT requests at
  5 req/s, OPT-13B on an A100-40GB (15.7K slots), step records on;
- ``offline.paged``: the same 1,000 requests all arriving at 0 (the offline throughput replays, with preemption);
- ``n4.paged.swap``: parallel sampling, 1,000 Alpaca requests with n = 4 at 7.5 req/s, swapping with 2,000 CPU
  blocks (notebook 04's Fig. 15 savings replay);
- ``beam4.paged.swap`` and ``beam4.orca_oracle.swap``: beam search of width 4 (``BeamModel.measured(4)``), 500
  Alpaca requests at 3 req/s, same swap space (Orca refills a re-forked beam's reservation with slot copies);
- ``search.paged`` and ``search.orca_oracle``: the online replay without step records (``record_steps=False``), as
  the rate searches and sensitivity bands run it (where the simulator takes steady decode steps as runs).

This tree's replays run compiled where its ``.build/fastsim`` is built and fresh (``pagedattn.repro.sim.fastsim``);
``--compile-baseline`` builds the other commit's compiled simulator too (where it has one), so that both run
compiled; each row records which simulator each tree ran. The other commit is exported with ``git archive`` into a temporary folder, and each round runs each replay of each
tree in a fresh subprocess (``PYTHONPATH`` pointing at that tree's ``src``), the trees in alternating order, so
that load on a shared machine hits both alike. Each replay's time is the child's CPU time (``time.process_time``)
around ``simulate`` (the trace is made before, once, by this tree, and both trees replay those very requests; ``--repeat`` replays per child, the fastest counts); the fastest of
the rounds is reported, and the ratio of the fastest times is the speed-up. The two trees must take the same number
of steps (the golden digests check the results).

    python benchmarks/sim_speed.py --baseline 2300914 --rounds 5 --repeat 3 [--kinds online.paged ...] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from pagedattn.repro.report.calibration import export_commit as export, tree_env  # noqa: E402  (a commit's tree)

CHILD = """
import json, math, time
import importlib
for sim_mod, trace_mod in [("pagedattn.repro.sim.simulator", "pagedattn.repro.workloads.traces"),
                           ("pagedattn.repro." + "sim", "pagedattn.repro." + "workloads"),  # before the folders
                           ("pagedattn.sim", "pagedattn.workloads")]:  # before the research code moved to repro
    try:
        sim_m, trace_m = importlib.import_module(sim_mod), importlib.import_module(trace_mod)
        break
    except ImportError:
        continue
BeamModel, simulate, TraceRequest = sim_m.BeamModel, sim_m.simulate, trace_m.TraceRequest
kind = {kind!r}
with open({trace_file!r}) as f:  # the requests, made once by this tree: both trees replay the same ones
    trace = [TraceRequest(r[0], float(r[1]), int(r[2]), int(r[3])) for r in json.load(f)]
system = kind.split(".")[1] if "." in kind else "paged"
if kind.startswith("online.") or kind == "offline.paged":
    args = (trace, system), {{}}
elif kind.startswith("search."):
    args = (trace, system), dict(record_steps=False)
elif kind == "n4.paged.swap":
    args = (trace, "paged"), dict(n=4, preemption_mode="swap", num_cpu_blocks=2000)
elif kind.startswith("beam4."):
    args = (trace, system), dict(beam=BeamModel.measured(4), preemption_mode="swap", num_cpu_blocks=2000)
best = float("inf")
for _ in range({repeat}):
    t = time.process_time()
    r = simulate(*args[0], **args[1])
    best = min(best, time.process_time() - t)
simulator = "interpreted"  # which simulator ran: the compiled copy where the tree has one built and fresh
for name in ("pagedattn.repro.sim.fastsim", "pagedattn.repro." + "fastsim"):  # (its place before the folders)
    try:
        fastsim = importlib.import_module(name)
    except ImportError:
        continue
    simulator = "compiled" if fastsim.status()[0] is not None else "interpreted: " + fastsim.status()[1]
    break
print(json.dumps({{"cpu_s": best, "steps": len(r.steps), "finish_sum": repr(float(r.requests["finish_time"].sum())),
                  "simulator": simulator}}))
"""
KINDS = ("online.paged", "online.orca_oracle", "offline.paged", "n4.paged.swap", "beam4.paged.swap",
         "beam4.orca_oracle.swap", "search.paged", "search.orca_oracle")


def compile_tree(src: Path) -> None:
    """Build a tree's compiled simulator in that tree (``python -m pagedattn.repro.sim.fastsim``), where it has one."""
    env = tree_env(src)
    repro = src / "src" / "pagedattn" / "repro"
    for path, module in ((repro / "sim" / "fastsim.py", "pagedattn.repro.sim.fastsim"),
                         (repro / "fastsim.py", "pagedattn.repro." + "fastsim")):  # (its place before the folders)
        if path.exists():
            subprocess.run([sys.executable, "-m", module], env=env, check=True, capture_output=True, cwd=str(src))
            return


def trace_for(kind: str, n: int, rate: float) -> list[tuple]:
    """The requests of a replay kind (module docstring), made by this tree's ``make_trace``: written to a file that
    each tree's child reads, so that both replay the same requests even where the trees' traces differ (the
    ShareGPT default changed with issue 50)."""
    from pagedattn.repro.workloads.traces import make_trace

    if kind.startswith(("online.", "search.")):
        trace = make_trace("sharegpt", n, rate, seed=0)
    elif kind == "offline.paged":
        trace = make_trace("sharegpt", n, math.inf, seed=0)
    elif kind == "n4.paged.swap":
        trace = make_trace("alpaca", n, 7.5, seed=0)
    else:  # beam4.*
        trace = make_trace("alpaca", n // 2, 3.0, seed=0)
    return [(r.request_id, r.arrival_time, r.prompt_len, r.output_len) for r in trace]


def replay(src: Path, kind: str, trace_file: Path, repeat: int) -> dict:
    env = tree_env(src)
    child = CHILD.format(kind=kind, trace_file=str(trace_file), repeat=repeat)
    out = subprocess.run([sys.executable, "-c", child], env=env, check=True, capture_output=True, text=True,
                         cwd=str(REPO)).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from pagedattn.repro.report.results import hardware_label, today, write_benchmark

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the commit to compare with (e.g. the golden-digest commit)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=1, help="replays per child process (its fastest counts)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=5.0, help="of the online replays")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--compile-baseline", action="store_true", help="build the baseline's compiled simulator")
    ap.add_argument("--out", default=None, help="JSON to write (default: results/benchmarks/sim_speed.json)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"baseline": export(args.baseline, Path(tmp)), "this tree": REPO}
        if args.compile_baseline:
            compile_tree(trees["baseline"])
        files = {}
        for kind in args.kinds:
            files[kind] = Path(tmp) / f"{kind}.json"
            files[kind].write_text(json.dumps(trace_for(kind, args.requests, args.rate)))
        best: dict = {}
        for i in range(args.rounds):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for kind in args.kinds:
                for name in order:
                    got = replay(trees[name], kind, files[kind], args.repeat)
                    key = (name, kind)
                    if key not in best or got["cpu_s"] < best[key]["cpu_s"]:
                        best[key] = got
            print(f"round {i + 1}: " + ", ".join(f"{k[0]} {k[1]} {v['cpu_s']:.3f} s" for k, v in best.items()),
                  flush=True)
    rows = {}
    for kind in args.kinds:
        base, new = best[("baseline", kind)], best[("this tree", kind)]
        same_finish = base.get("finish_sum", new["finish_sum"]) == new["finish_sum"]  # an old tree prints none
        if base["steps"] != new["steps"] or not same_finish:
            raise SystemExit(f"{kind}: the two trees took different numbers of steps ({base['steps']} vs "
                             f"{new['steps']}) or finished at other times: not the same replay")
        rows[kind] = {"baseline_cpu_s": base["cpu_s"], "cpu_s": new["cpu_s"], "steps": new["steps"],
                      "speedup": base["cpu_s"] / new["cpu_s"], "baseline_simulator": base.get("simulator"),
                      "simulator": new.get("simulator")}
        print(f"{kind:18s} baseline {base['cpu_s']:.3f} s, this tree {new['cpu_s']:.3f} s: "
              f"{rows[kind]['speedup']:.2f}x ({new['steps']} steps)")
    write_benchmark({"benchmark": "sim_speed", "hardware": hardware_label(), "date": today(),
                     "baseline": args.baseline, "rounds": args.rounds, "repeat": args.repeat, "requests": args.requests,
                     "rate": args.rate, "load_average": os.getloadavg(), "replays": rows},
                    "sim_speed", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
