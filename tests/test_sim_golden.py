"""Golden digests of the simulator (issue 26): a hash of every ``SimResult`` field (the step records, the per-request
metrics, the preemption counts, the prefix hit rate, the prompt tokens computed) for a fixed set of replays that
covers every system, recompute and swap, parallel sampling, beam search, prefix caching (user-marked and automatic,
with swapping), both placements, a second block size and all three traces.
Each case is also replayed without step records (``record_steps=False``, as the rate searches and bands run), with a
digest of its own, and must reach the same per-request results as when it records every step.

The digests were committed before the simulator was optimised: any change to a replay's result, however small,
changes a digest. A change that is meant to alter results (a fixed divergence) must re-commit them with the reason
in its message: ``python tests/test_sim_golden.py --write``.

The hash is of values, not of storage: columns sorted by name, every number as ``repr(float(x))`` (so an ``int``
column stored as ``float`` hashes the same, and any change of value does not), booleans and strings as themselves,
NaN/None as one token. The cost model is spelled out (``GOLDEN_COST``) so that a change of ``CostModel``'s defaults
does not move the digests; the replays' behaviour is what they pin.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import sys
from pathlib import Path

import pandas as pd
import pytest

from pagedattn.repro.sim.simulator import BeamModel, CostModel, simulate
from pagedattn.repro.workloads.traces import make_trace

DIGESTS = Path(__file__).parent / "fixtures" / "sim_digests.json"
#: The step-time constants of the digests (the defaults of 2026-12-01, written out).
GOLDEN_COST = dict(bandwidth_efficiency=0.7, flops_efficiency=0.5, step_overhead_s=0.004, step_overhead_per_seq_s=0.0)


def _cost(**kw) -> CostModel:
    return CostModel(**{**GOLDEN_COST, **kw})


def _prefix_prompts(trace, prefix_len: int, seed: int) -> tuple[dict, dict]:
    """Prompts whose first ``prefix_len`` tokens are shared (so prefix hashes match) and the rest distinct."""
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(1, 32000) for _ in range(prefix_len)]
    prompts = {r.request_id: (prefix + [rng.randrange(1, 32000) for _ in range(r.prompt_len)])[:max(r.prompt_len,
                                                                                                    prefix_len + 4)]
               for r in trace}
    return prompts, {rid: prefix_len for rid in prompts}


def _with_prompt_lens(trace, prompts):
    from pagedattn.repro.workloads.traces import TraceRequest

    return [TraceRequest(r.request_id, r.arrival_time, len(prompts[r.request_id]), r.output_len) for r in trace]


def case(*args, **kwargs):
    """A replay to run later: ``simulate(*args, **kwargs)``, with ``**kw`` of the call on top (``record_steps``)."""
    return lambda **kw: simulate(*args, **{**kwargs, **kw})


def cases() -> dict:
    """name -> a function that runs the replay (small enough that all of them take seconds); each takes
    ``record_steps=False`` too, for its digest without step records (``NO_STEPS``)."""
    share = make_trace("sharegpt", 300, 5.0, seed=1)
    synth = make_trace("sharegpt_synthetic", 200, 4.0, seed=2)
    alpaca = make_trace("alpaca", 400, 40.0, seed=3)
    offline = make_trace("sharegpt", 150, math.inf, seed=4)
    out = {}
    for system in ("paged", "orca_max", "orca_pow2", "orca_oracle", "ft"):
        out[f"sharegpt.{system}"] = case(share, system, 4000, cost=_cost())
    out["sharegpt.orca_oracle.exact"] = case(share, "orca_oracle", 4000, cost=_cost(), placement="exact")
    out["sharegpt.paged.block32"] = case(share, "paged", 4000, 32, cost=_cost())
    out["sharegpt.paged.no_steps"] = case(share, "paged", 4000, cost=_cost(), record_steps=False)
    out["offline.paged.max_steps"] = case(offline, "paged", 3000, cost=_cost(), max_steps=400)
    out["offline.orca_oracle"] = case(offline, "orca_oracle", 3000, cost=_cost(step_overhead_s=0.0))
    out["synthetic.paged.recompute"] = case(synth, "paged", 3000, cost=_cost())
    out["synthetic.paged.swap"] = case(synth, "paged", 3000, cost=_cost(), preemption_mode="swap",
                                                   num_cpu_blocks=400)
    out["synthetic.paged.n4.swap"] = case(synth[:100], "paged", 3000, cost=_cost(), n=4, seed=5,
                                                      preemption_mode="swap", num_cpu_blocks=200)
    out["synthetic.orca_oracle.n2"] = case(synth, "orca_oracle", 3000, cost=_cost(), n=2, seed=6)
    out["alpaca.paged"] = case(alpaca, "paged", 2000, cost=_cost())
    out["alpaca.paged.swap.small_cpu"] = case(alpaca, "paged", 1200, 8, cost=_cost(),
                                                          preemption_mode="swap", num_cpu_blocks=30)
    out["alpaca.orca_pow2"] = case(alpaca, "orca_pow2", 2000, cost=_cost())
    out["alpaca.paged.beam4"] = case(make_trace("alpaca", 200, 10.0, seed=12), "paged", 6000, cost=_cost(), seed=7,
                                                 beam=BeamModel.measured(4))
    out["alpaca.paged.beam6.swap"] = case(alpaca[:200], "paged", 1500, cost=_cost(), seed=8,
                                                      beam=BeamModel.measured(6), preemption_mode="swap",
                                                      num_cpu_blocks=100)
    out["alpaca.orca_oracle.beam2"] = case(alpaca[:200], "orca_oracle", 2000, cost=_cost(), seed=9,
                                                       beam=BeamModel(2, 1.5))
    pre = make_trace("alpaca", 250, 30.0, seed=10)
    prompts, marks = _prefix_prompts(pre, 40, seed=11)
    pre = _with_prompt_lens(pre, prompts)
    out["prefix.user"] = case(pre, "paged", 1500, cost=_cost(), prompts=prompts, prefix_lens=marks)
    out["prefix.auto"] = case(pre, "paged", 1500, cost=_cost(), prompts=prompts,
                                          enable_prefix_caching=True)
    out["prefix.auto.charge_cached"] = case(pre, "paged", 1500, cost=_cost(), prompts=prompts,
                                                        enable_prefix_caching=True, charge_cached=True)
    out["prefix.auto.swap"] = case(pre, "paged", 800, cost=_cost(), prompts=prompts,
                                               enable_prefix_caching=True, preemption_mode="swap",
                                               num_cpu_blocks=60)
    out["prefix.user.orca_oracle"] = case(pre, "orca_oracle", 1500, cost=_cost(), prompts=prompts)
    return out


def _token(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "~"
    if isinstance(v, (bool, str)):
        return repr(v)
    if hasattr(v, "item"):  # a numpy scalar
        return _token(v.item())
    return repr(float(v))


def _frame(h, df) -> None:
    h.update(f"rows={len(df)};cols={sorted(map(str, df.columns))}".encode())
    for col in sorted(df.columns, key=str):
        h.update(f"|{col}:".encode())
        h.update(",".join(_token(v) for v in df[col].tolist()).encode())


def digest(res) -> str:
    """A SHA-256 of every field of a ``SimResult``, by value (see the module docstring)."""
    h = hashlib.sha256()
    h.update(res.system.encode())
    _frame(h, res.steps)
    _frame(h, res.requests)
    h.update(json.dumps({k: int(v) for k, v in sorted(res.num_preemptions.items())}).encode())
    h.update(_token(res.prefix_hit_rate).encode() + _token(res.prefill_tokens_computed).encode())
    return h.hexdigest()


PATHS = ("interpreted", "compiled")
#: The suffix of a case's replay without step records (``record_steps=False``, what rate searches run): its own digest
NO_STEPS = " without step records"


@functools.cache
def results(path: str = "interpreted") -> dict:
    """Every case's ``SimResult``, run once per test session (the tests below only read them), by the interpreted
    simulator or by its compiled copy (``pagedattn.repro.sim.fastsim``; every replay must go there: a replay that falls
    back to the interpreter fails)."""
    from pagedattn.repro.sim import fastsim

    status, replay, fell_back = fastsim.status, fastsim.replay, []

    def compiled_only(args, sim):
        r = replay(args, sim)
        if r is None:
            fell_back.append(args.get("system"))
        return r
    if path == "compiled" and fastsim.status()[0] is None:
        pytest.skip(f"no compiled simulator: {fastsim.status()[1]}")
    if path == "interpreted":
        fastsim.status = lambda: (None, "interpreted by the test")
    else:
        fastsim.replay = compiled_only
    try:
        out = {name: run() for name, run in cases().items()}
        out.update({name + NO_STEPS: run(record_steps=False) for name, run in cases().items()
                    if not name.endswith("no_steps")})
    finally:
        fastsim.status, fastsim.replay = status, replay
    assert not fell_back, f"replays fell back to the interpreter: {fell_back}"
    return out


def compute(path: str = "interpreted") -> dict[str, str]:
    return {name: digest(res) for name, res in results(path).items()}


@pytest.mark.parametrize("path", PATHS)
def test_golden_digests(path):
    want = json.loads(DIGESTS.read_text())
    got = compute(path)
    assert sorted(got) == sorted(want)
    changed = [name for name in want if got[name] != want[name]]
    assert not changed, f"simulator results changed for {changed}"


@pytest.mark.parametrize("name", ["sharegpt.paged", "synthetic.paged.n4.swap"])
def test_digest_sees_a_one_token_change(name):
    """The digest is not blind: moving one request's finish time, or one step's breakdown, changes it."""
    res = cases()[name]()
    before = digest(res)
    res.requests.loc[res.requests.index[5], "finish_time"] += 1e-9
    assert digest(res) != before
    res = cases()[name]()
    res.steps.loc[res.steps.index[7], "token_states"] += 1
    assert digest(res) != before


def test_cases_exercise_what_they_name():
    """Each feature the digests are meant to pin actually happens in its replay."""
    r = results()
    assert r["synthetic.paged.swap"].num_preemptions["swap"] > 0
    assert r["synthetic.paged.recompute"].num_preemptions["recompute"] > 0
    assert r["alpaca.paged.swap.small_cpu"].num_preemptions["recompute"] > 0  # the CPU pool runs out
    assert r["prefix.auto.swap"].num_preemptions["swap"] > 0
    assert r["prefix.auto"].prefix_hit_rate > 0.5
    assert r["prefix.user"].prefix_hit_rate > r["prefix.auto"].prefix_hit_rate  # marked prefixes are pinned
    assert r["alpaca.paged.beam4"].sharing_saving() > 0.2
    assert r["synthetic.paged.n4.swap"].sharing_saving() > 0.05
    assert r["synthetic.orca_oracle.n2"].requests["error"].notna().any()  # refusals are pinned too
    assert r["sharegpt.paged.no_steps"].steps.empty
    for name in ("sharegpt.orca_max", "alpaca.paged"):
        assert r[name].steps["memory_bound"].any(), name


if __name__ == "__main__":
    if "--write" in sys.argv:
        DIGESTS.write_text(json.dumps(compute(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {DIGESTS}")
    else:
        print(json.dumps(compute(), indent=1, sort_keys=True))


@pytest.mark.parametrize("path", PATHS)
def test_a_replay_without_step_records_has_the_same_results(path):
    """A replay that records no steps (``record_steps=False``: the rate searches, the bands) reaches the same
    per-request times, preemptions, hit rate and computed tokens as the same replay recording every step."""
    r = results(path)
    for name in cases():
        if name + NO_STEPS in r:
            with_steps = r[name]
            without = dataclasses.replace(with_steps, steps=pd.DataFrame())
            assert r[name + NO_STEPS].steps.empty
            assert digest(r[name + NO_STEPS]) == digest(without), name
