"""What the experiments share: the parameter base class, the small CPU model, scaled traces, the engine of a system,
replaying a trace on a real engine against a clock, and timing by the fastest run.

Every experiment module (``experiments/<name>.py``) reproduces one paper result; the pieces here are the same in
all of them and live once, with each experiment's differences (the model's shape, how lengths are rounded, which
clock) passed as parameters.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import numpy as np
import pandas as pd

from pagedattn.repro.paper import DEFAULT_BLOCK_SIZE
from pagedattn.repro.workloads.traces import TraceRequest, make_trace


# ------------------------------------------------------------------------------------------------ parameters
@dataclass
class ExperimentParams:
    """The fields every experiment's parameters start with, and ``make``: ``QUICK`` holds the values a quick run
    (``quick=True``: CI and ``make reproduce QUICK=1``) uses unless the caller passes its own. Subclasses are
    dataclasses marked ``@validated`` (``pagedattn.repro.experiments``)."""

    quick: bool = False
    seed: int = 0
    #: the quick run's values (copied per call, so that a run never shares a mutable default with another)
    QUICK: ClassVar[dict] = {}

    @classmethod
    def make(cls, quick: bool = False, **kw):
        if quick:
            kw = {**copy.deepcopy(cls.QUICK), **kw}
        return cls(quick=quick, **kw)


@dataclass
class ServingParams(ExperimentParams):
    """An experiment that serves requests: the parameters above and the KV block size (tokens per block)."""

    block_size: int = DEFAULT_BLOCK_SIZE


# ------------------------------------------------------------------------------------------------ CPU model
def __getattr__(name: str):
    """``tiny_opt`` and ``TINY_OPT_SHAPE``, the experiments' model (``pagedattn.model.tiny``), re-exported on first
    use: importing it imports torch (about a second), which the notebooks that only simulate never need."""
    if name in ("tiny_opt", "TINY_OPT_SHAPE"):
        from pagedattn.model import tiny

        return getattr(tiny, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tiny_opt_cached(seed: int = 0, **shape):
    """``tiny_opt(seed, **shape)``, built once per process and shared by later calls with the same arguments: a
    sweep's task builds its model in its worker from the seed (the same weights in every process: the
    initialisation is seeded; ``tests/test_parallel.py`` checks it across processes) instead of receiving it
    pickled. The engines never change the weights."""
    return _tiny_opt(seed, tuple(sorted(shape.items())))


@functools.lru_cache(maxsize=4)
def _tiny_opt(seed: int, shape: tuple):
    from pagedattn.model.tiny import tiny_opt

    return tiny_opt(seed, **dict(shape))


@contextlib.contextmanager
def torch_threads(n: int):
    """Run a block with ``n`` torch threads (restored after): a real-engine task sets its own, in a sweep's worker
    or in this process when the sweep runs serially."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------ traces
def scaled_trace(name: str, num_requests: int, scale: int, rate: float = math.inf, seed: int = 0,
                 round_up: bool = False) -> list[TraceRequest]:
    """The named trace (``workloads.make_trace``) with every prompt and output length divided by ``scale``, at
    least 1 token each: rounded to the nearest integer, or up with ``round_up``."""
    def cut(n: int) -> int:
        return -(-n // scale) if round_up else max(1, round(n / scale))

    return [TraceRequest(r.request_id, r.arrival_time, cut(r.prompt_len), cut(r.output_len))
            for r in make_trace(name, num_requests, rate, seed)]


# ------------------------------------------------------------------------------------------------ engines
def make_engine(model, system: str, num_slots: int, block_size: int = 16, max_model_len: int = 2048, **engine_kw):
    """An ``LLMEngine`` serving as ``system`` (``paged``; ``paged_user`` and ``paged_auto``: paged, the latter with
    automatic prefix caching; ``orca_max`` / ``orca_pow2`` / ``orca_oracle``; ``ft``: Orca (Max)'s reservation with
    static batching) over ``num_slots`` token slots, the same budget for every system. It keeps every step's
    metrics unless ``max_step_metrics`` says otherwise (a server passes a bound). The KV manager is the engine's
    ``EngineArgs.kv_manager`` (``memory.systems``, the one mapping from a system to its manager, the simulator's too)."""
    from pagedattn.engine import LLMEngine
    from pagedattn.memory.systems import engine_system

    engine_kw.setdefault("max_step_metrics", None)  # an experiment reads every step's metrics, however many
    name, caching = engine_system(system)
    return LLMEngine(model, engine_kw.pop("tokenizer", None), name, num_slots=num_slots, block_size=block_size,
                     max_model_len=max_model_len, num_cpu_blocks=engine_kw.pop("num_cpu_blocks", 0),
                     enable_prefix_caching=caching, **engine_kw)


# ------------------------------------------------------------------------------------------------ replay
class Clock:
    """Replay time in seconds: a timer plus jumps over idle gaps (``advance_to``: when no request is in the system
    before the next arrival, the clock jumps to it, as if the engine had waited).

    The timer is ``time.thread_time`` by default: this thread's CPU time. On a shared machine other processes
    stretch wall time by whatever they run (we saw the load average at 5-7 on 2 cores); the CPU time the engine
    spends does not depend on them (beyond cache effects). ``time.process_time`` counts every thread of the process,
    ``time.perf_counter`` is wall time. ``steps_only``: only the time inside ``step`` counts (the engine's own work,
    not the driver's between steps)."""

    def __init__(self, timer: Callable[[], float] = time.thread_time, steps_only: bool = False) -> None:
        self.timer, self.steps_only = timer, steps_only
        self._t0, self._offset = timer(), 0.0

    def _elapsed(self) -> float:
        return 0.0 if self.steps_only else self.timer() - self._t0

    def __call__(self) -> float:
        return self._offset + self._elapsed()

    def advance_to(self, t: float) -> None:
        self._offset = max(self._offset, t - self._elapsed())

    def step(self, engine) -> list:
        """``engine.step()``, timed."""
        t0 = self.timer()
        outputs = engine.step()
        if self.steps_only:
            self._offset += self.timer() - t0
        return outputs


@dataclass(frozen=True)
class Arrival:
    """One request of a replay: ``engine.add_request(request_id, prompt, params, **add_kw)`` once the clock reaches
    ``time``."""

    time: float
    request_id: str
    prompt: list[int]
    params: object  # SamplingParams
    add_kw: dict = field(default_factory=dict)


@dataclass
class Replay:
    """What a replay saw: each request's output and the clock when its first token and its last came, and the
    number of running requests after every step."""

    outputs: dict = field(default_factory=dict)
    first_token: dict = field(default_factory=dict)
    finish: dict = field(default_factory=dict)
    running: list = field(default_factory=list)
    duration: float = 0.0


def greedy(max_tokens: int):
    """Greedy decoding to exactly ``max_tokens`` tokens (``ignore_eos``), as every trace replay generates."""
    from pagedattn.sequence import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def replay(engine, arrivals: list[Arrival], clock: Clock) -> Replay:
    """Serve ``arrivals`` on a real engine in real time on ``clock``: a request is added once the clock has reached
    its arrival, the engine steps while requests are in it, and when it is empty the clock jumps to the next
    arrival (serving as it would happen, without waiting for arrivals)."""
    pending = sorted(arrivals, key=lambda a: a.time)
    out = Replay()
    i = 0
    while i < len(pending) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            clock.advance_to(pending[i].time)
        while i < len(pending) and pending[i].time <= clock():
            a = pending[i]
            engine.add_request(a.request_id, a.prompt, a.params, **a.add_kw)
            i += 1
        outputs = clock.step(engine)
        out.running.append(len(engine.scheduler.running))
        for o in outputs:
            if o.request_id not in out.first_token and o.outputs[0].token_ids:
                out.first_token[o.request_id] = clock()
            if o.finished:
                out.outputs[o.request_id], out.finish[o.request_id] = o, clock()
    out.duration = clock()
    return out


# ------------------------------------------------------------------------------------------------ timing
def fastest(fns: dict[str, Callable[[], object]], reps: int, clock: Callable[[], float] = time.thread_time,
            sync: Callable[[], object] = lambda: None, order_seed: int | None = None, min_reps: int | None = None,
            budget_s: float | None = None) -> tuple[dict[str, float], int]:
    """Each function's fastest run in seconds of ``clock`` (default: this thread's CPU time, so other processes on a
    shared machine do not count; the minimum is the run they disturbed least), after one warm-up each. The
    functions run round-robin, so load hits all of them alike: in a fixed order, or with ``order_seed`` in a new
    random order each round (no position bias). ``sync`` runs after each call (a device synchronisation when the
    work is asynchronous). Up to ``reps`` rounds; with ``budget_s``, it stops early once ``min_reps`` rounds are
    done and ``budget_s`` seconds of wall time have passed. Returns the times and the rounds run."""
    for fn in fns.values():
        fn()
        sync()
    keys = list(fns)
    rng = np.random.default_rng(order_seed) if order_seed is not None else None
    best = {k: math.inf for k in keys}
    start, n = time.perf_counter(), 0
    while n < reps:
        for i in rng.permutation(len(keys)) if rng is not None else range(len(keys)):
            t = clock()
            fns[keys[i]]()
            sync()
            best[keys[i]] = min(best[keys[i]], clock() - t)
        n += 1
        if budget_s is not None and n >= (reps if min_reps is None else min_reps) \
                and time.perf_counter() - start >= budget_s:
            break
    return best, n


def requests_frame(trace: list[TraceRequest], served: Replay) -> pd.DataFrame:
    """One row per request of ``trace``: its lengths, arrival, first-token and finish times on the replay's clock,
    its error (if any) and its generated tokens."""
    rows = []
    for r in sorted(trace, key=lambda r: r.arrival_time):
        o = served.outputs.get(r.request_id)
        rows.append({"request_id": r.request_id, "arrival_time": r.arrival_time, "prompt_len": r.prompt_len,
                     "output_len": r.output_len, "first_token_time": served.first_token.get(r.request_id),
                     "finish_time": served.finish.get(r.request_id), "error": o.error if o else None,
                     "tokens": o.outputs[0].token_ids if o else []})
    return pd.DataFrame(rows)
