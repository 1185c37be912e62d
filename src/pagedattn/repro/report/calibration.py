"""A clock that travels (issue 64): a run's minutes stated in units of the machine's own speed at that hour.

Two 2-core VMs ran the same notebooks 2-3x apart, and one VM differs from itself between a quiet and a busy hour,
so an absolute time says little. ``make reproduce`` therefore times two fixed workloads before its first notebook
and after its last (``measure``), each repeated for at least ``SECONDS_EACH`` of wall time:

- **replay**: one fixed simulator replay (``benchmarks/sim_speed.py``'s ``online.paged``: 1,000 ShareGPT requests
  at 5 req/s, paged, OPT-13B on an A100-40GB), the work of most notebooks;
- **engine**: one fixed small workload of the real engine (the tiny OPT of ``pagedattn.model.tiny``, one torch
  thread, paged, ``ENGINE_REQUESTS`` greedy requests of ``ENGINE_PROMPT`` prompt and ``ENGINE_OUTPUT`` output
  tokens), the work of the notebooks that time engines.

The *calibration unit* is the fastest replay plus the fastest engine workload, in wall seconds (the fastest of the
repeats is the one other processes disturbed least). A notebook's seconds divided by the mean unit before and after
the run are its time in units, which the same commit takes on any machine at any hour up to the notebook's own mix
of work; times ``REFERENCE_UNIT_S`` they are the minutes it would take on the reference VM (``REFERENCE_VM``, fixed
once in docs/REPRODUCING.md). ``normalised`` does that arithmetic; ``reproduce`` writes both into each ``run.json``.
"""
from __future__ import annotations

import functools
import math
import os
import time
from typing import Callable

#: each workload repeats until this many wall seconds have passed (at least twice): a calibration of >= 2 s in all
SECONDS_EACH = 1.0
ENGINE_REQUESTS, ENGINE_PROMPT, ENGINE_OUTPUT = 8, 64, 32
REPLAY = "sim_speed online.paged: 1,000 ShareGPT requests at 5 req/s, paged, OPT-13B/A100-40GB"
ENGINE = (f"tiny OPT (pagedattn.model.tiny), one torch thread, paged, {ENGINE_REQUESTS} greedy requests of "
          f"{ENGINE_PROMPT} + {ENGINE_OUTPUT} tokens")
#: The reference VM (docs/REPRODUCING.md), fixed once on 2026-12-07: the developers' 2-core AMD EPYC (AVX-512 BF16)
#: VM of the committed full run of 6a7449b (33.6 minutes), on which the fixed replay took ``REFERENCE_REPLAY_S``
#: (its ``run.json``'s ``calibration_replay``, the fastest of three at load 1.5, compiled simulator). The engine
#: workload was not run there: it is put at 0.413 of the replay, its ratio measured on a VM of the same label on
#: 2026-12-07 (CPU seconds, three calibrations: engine 0.101 s, replay 0.246 s), so the unit is 0.154 x 1.413.
REFERENCE_VM = "cpu: AMD EPYC (AVX-512 BF16), 2 cores: the developers' VM of the full run of 6a7449b"
REFERENCE_REPLAY_S = 0.154
REFERENCE_UNIT_S = 0.218
#: ``PAGEDATTN_CALIBRATION=0`` skips the calibration (``run.json`` then records ``null``): the test suite's fake
#: notebooks take seconds and need none.
ENV = "PAGEDATTN_CALIBRATION"


def _fastest(fn: Callable[[], object], min_s: float) -> dict:
    """``fn`` repeated until ``min_s`` wall seconds have passed (at least twice): its fastest wall and CPU seconds
    and the number of runs."""
    wall, cpu, runs, start = math.inf, math.inf, 0, time.perf_counter()
    while runs < 2 or time.perf_counter() - start < min_s:
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall, cpu, runs = min(wall, time.perf_counter() - w), min(cpu, time.process_time() - c), runs + 1
    return {"wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "runs": runs}


@functools.lru_cache(maxsize=1)
def _replay_trace():
    from pagedattn.repro.workloads.traces import make_trace

    return make_trace("sharegpt", 1000, 5.0, seed=0)


def replay_once() -> None:
    """The fixed simulator replay."""
    from pagedattn.repro.sim.simulator import simulate

    simulate(_replay_trace(), "paged")


@functools.lru_cache(maxsize=1)
def _engine_model():
    from pagedattn.model.tiny import tiny_opt

    return tiny_opt(0)


def engine_once() -> None:
    """The fixed engine workload, on one torch thread."""
    import torch

    from pagedattn.engine import LLMEngine
    from pagedattn.sequence import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LLMEngine(_engine_model(), None, "paged", num_slots=4096, block_size=16, max_model_len=512)
        params = SamplingParams(temperature=0, max_tokens=ENGINE_OUTPUT, ignore_eos=True)
        for i in range(ENGINE_REQUESTS):
            engine.add_request(str(i), [(7 * i + j) % 500 + 2 for j in range(ENGINE_PROMPT)], params)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        torch.set_num_threads(threads)


def measure(min_s: float | None = None) -> dict | None:
    """Both workloads (module docstring), each for at least ``min_s`` seconds (default ``SECONDS_EACH``); ``None``
    where ``$PAGEDATTN_CALIBRATION`` is ``0``. ``unit_s``: the fastest replay plus the fastest engine workload."""
    if os.environ.get(ENV, "1") == "0":
        return None
    min_s = SECONDS_EACH if min_s is None else min_s
    start = time.perf_counter()
    replay_once(), engine_once()  # warm-up: imports, the trace, the model
    replay, engine = _fastest(replay_once, min_s), _fastest(engine_once, min_s)
    return {"replay": {"workload": REPLAY, **replay}, "engine": {"workload": ENGINE, **engine},
            "unit_s": round(replay["wall_s"] + engine["wall_s"], 4), "seconds": round(time.perf_counter() - start, 2),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def normalised(seconds: float, before: dict | None, after: dict | None) -> dict | None:
    """``seconds`` in calibration units (over the mean unit of ``before`` and ``after``, either alone where the other
    is missing) and as minutes on the reference VM; ``None`` with no calibration."""
    units = [c["unit_s"] for c in (before, after) if c]
    if not units:
        return None
    unit = sum(units) / len(units)
    return {"unit_s": round(unit, 4), "units": round(seconds / unit, 1),
            "reference_vm_minutes": round(seconds / unit * REFERENCE_UNIT_S / 60, 2)}
