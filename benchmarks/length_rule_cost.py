"""The trace-length rule's cost and n-vs-2n agreement on notebook 03's quick settings with the real 2 % resolution
(issue 50): each simulator search once on the quick length (single) and under ``capacity.length_agreed_rate`` (rule,
with the knee). Run: PYTHONPATH=src OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/length_rule_cost.py
(``--full``: notebook 03's full ShareGPT length, 1,000 requests, for paged, Orca (Oracle) and Orca (Max))."""
import sys
import time, json
from functools import partial
from pagedattn.repro.sim import capacity
from pagedattn.repro.experiments import throughput as T
calls = {"n": 0, "reqs": 0}
orig = T.sim_run
def counted(trace, *a, **k):
    calls["n"] += 1; calls["reqs"] += len(trace); return orig(trace, *a, **k)
T.sim_run = counted
FULL = "--full" in sys.argv
p = T.SimParams() if FULL else T.SimParams(**{**T.SimParams.QUICK, "rate_resolution": capacity.RESOLUTION})
out = []
for w in (("sharegpt",) if FULL else ("sharegpt", "alpaca")):
    lo, hi = min(p.rates[w]) / 4, max(p.rates[w]) * 16
    for s in (("paged", "orca_oracle", "orca_max") if FULL else T.SIM_SYSTEMS):
        calls.update(n=0, reqs=0); t = time.time()
        f = capacity.sustainable_rate(partial(T._sim_requests, n=p.num_requests[w], w=w, system=s, params=p, cost=None), lo, hi, capacity.NL_THRESHOLD_S, p.rate_resolution)
        one = dict(calls); t1 = time.time() - t
        calls.update(n=0, reqs=0); t = time.time()
        r = T._sim_sustainable_row((w, p.num_requests[w], s, lo, hi), p, None)
        t2 = time.time() - t
        out.append(dict(trace=w, system=s, n=p.num_requests[w], single=f.rate, single_bound=capacity.bound(f.bound_by),
                        rate=r["sustainable_rate"], half=r["rate_at_half_length"], at=r["search_requests"],
                        agreed=r["length_agreed"], bound=r["bound"], knee=r["knee_rate"], single_replays=one["n"],
                        single_reqs=one["reqs"], rule_replays=calls["n"], rule_reqs=calls["reqs"], t_single=round(t1,2), t_rule=round(t2,2)))
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in out[-1].items()}), flush=True)
