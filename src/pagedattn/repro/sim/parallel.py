"""One executor for every independent piece of a sweep (issue 26): rate points, systems, sensitivity points, traces,
model sizes, whole bisections.

``pmap(fn, items)`` is ``[fn(x) for x in items]``, computed

- in this process, with one job (``jobs=1``) or a single item;
- on a process pool of ``jobs`` workers (default: one per core), kept for the session and reused by every sweep;
- on a Dask ``distributed`` cluster, given its scheduler's address (``tcp://HOST:8786``): the same sweep on as many
  machines as the cluster has, with no cluster code of ours.

Where it runs never changes what it returns: results come back in the order of ``items``, and every task carries
its own inputs, seeds included (a task that draws random numbers takes its seed as an argument; no task reads a
worker's state), and the caller's ``PAGEDATTN_*`` environment variables (``PAGEDATTN_SENSITIVITY_CACHE``, say).
``fn`` must be picklable: a module-level function, or a ``functools.partial`` of one.

How many jobs and which cluster: ``configure(jobs=..., scheduler=...)`` (a notebook's ``jobs`` / ``scheduler``
parameters), else the environment (``PAGEDATTN_JOBS``, ``PAGEDATTN_SCHEDULER``: ``pagedattn.repro.report.reproduce --jobs N
--scheduler ADDRESS`` sets them for every notebook), else one job per core on this machine. A task that itself
calls ``pmap`` (a sweep inside a sweep) runs its inner sweep serially in its worker.

What belongs here: work whose result does not depend on timing (the simulator, arithmetic, correctness checks),
and real-engine replays timed by their own process's CPU time (``time.process_time`` with one torch thread, as
``experiments.throughput.serve`` and ``experiments.sharing`` do), which a neighbour on another core does not add
to, with at most one job per core. Wall-clock and kernel timings (``common.fastest`` on a device, latency
benchmarks) share no core with a sweep.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from functools import partial
from typing import Any, Callable, Iterable

from tqdm.auto import tqdm

from pagedattn.repro.progress import interactive

_settings: dict[str, Any] = {"jobs": None, "scheduler": None}
_pool: tuple[int, Executor] | None = None
_clients: dict[str, Any] = {}
IN_WORKER = "PAGEDATTN_IN_WORKER"


def configure(jobs: int | None = None, scheduler: str | None = None) -> None:
    """Set the number of local jobs and/or a Dask scheduler address for every later ``pmap`` (None: from the
    environment, else one job per core)."""
    if jobs is not None and (not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1):
        raise ValueError(f"jobs must be an integer >= 1, got {jobs!r}")
    _settings.update(jobs=jobs, scheduler=scheduler or None)


def num_jobs() -> int:
    """Local worker processes a sweep uses: 1 inside a worker, else ``configure``'s, ``PAGEDATTN_JOBS`` or the
    number of cores."""
    if os.environ.get(IN_WORKER):
        return 1
    if _settings["jobs"] is not None:
        return _settings["jobs"]
    env = os.environ.get("PAGEDATTN_JOBS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"PAGEDATTN_JOBS must be an integer >= 1, got {env!r}") from None
        if n < 1:
            raise ValueError(f"PAGEDATTN_JOBS must be an integer >= 1, got {env!r}")
        return n
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def scheduler_address() -> str | None:
    """The Dask scheduler sweeps go to (``configure``'s, else ``PAGEDATTN_SCHEDULER``), None inside a worker."""
    if os.environ.get(IN_WORKER):
        return None
    return _settings["scheduler"] or os.environ.get("PAGEDATTN_SCHEDULER") or None


def _mark_worker() -> None:
    """Mark this process as a sweep's worker: a sweep inside one of its tasks runs serially there."""
    os.environ[IN_WORKER] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _start_pool_worker() -> None:
    """A pool worker's set-up: marked as a worker, and an interrupt meant for the parent (a notebook kernel being
    stopped signals its whole process group) prints no traceback from every worker: the parent shuts the pool
    down."""
    _mark_worker()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _as_worker(fn: Callable[[Any], Any], x: Any) -> Any:
    """``fn(x)`` in a process marked as a worker (a task on a Dask worker, which runs no ``_mark_worker``
    initializer)."""
    _mark_worker()
    return fn(x)


def _caller_env() -> dict[str, str]:
    """The caller's settings that travel with each task: its ``PAGEDATTN_*`` environment variables (the worker mark
    aside). A pool started earlier, or a Dask worker, has an environment of its own."""
    return {k: v for k, v in os.environ.items() if k.startswith("PAGEDATTN_") and k != IN_WORKER}


def _in_caller_env(env: dict[str, str], fn: Callable[[Any], Any], x: Any) -> Any:
    """``fn(x)`` with this process's ``PAGEDATTN_*`` variables set to the caller's ``env`` (and none of its own)."""
    for k in [k for k in os.environ if k.startswith("PAGEDATTN_") and k != IN_WORKER and k not in env]:
        del os.environ[k]
    os.environ.update(env)
    return fn(x)


def process_pool(jobs: int) -> Executor:
    """The session's process pool of ``jobs`` workers (made on first use, remade when ``jobs`` changes). Workers
    start from a fork server, not by forking this process, which may hold threads (torch's) that a fork would
    copy in a locked state."""
    global _pool
    if _pool is not None and _pool[0] == jobs:
        return _pool[1]
    shutdown()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["pagedattn.repro.sim.simulator"])
    _pool = (jobs, ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_start_pool_worker))
    return _pool[1]


def dask_client(address: str):
    """A ``distributed.Client`` connected to ``address`` (one per address for the session)."""
    if address not in _clients:
        from distributed import Client

        _clients[address] = Client(address, set_as_default=False)
    return _clients[address]


def shutdown() -> None:
    """Stop the process pool and close the Dask clients (the next sweep starts afresh)."""
    global _pool
    if _pool is not None:
        _pool[1].shutdown(cancel_futures=True)
        _pool = None
    while _clients:
        _clients.popitem()[1].close()


atexit.register(shutdown)


def pmap(fn: Callable[[Any], Any], items: Iterable[Any], desc: str | None = None, progress: bool = False,
         jobs: int | None = None) -> list:
    """``[fn(x) for x in items]`` on the configured executor (module docstring), in the order of ``items``.
    ``jobs`` overrides the configured number for this call; ``progress`` shows a tqdm bar as tasks finish."""
    return pstart(fn, items, desc, progress, jobs).result()


def pstart(fn: Callable[[Any], Any], items: Iterable[Any], desc: str | None = None, progress: bool = False,
           jobs: int | None = None) -> "Started":
    """``pmap`` without waiting (issue 64: both cores busy in every phase): the tasks go to the executor now, ahead
    of every later sweep's, and ``.result()`` collects them. A notebook starts its longest chains of work (a real
    engine's sequential searches) first and runs its other sweeps meanwhile, so that no worker idles while one
    chain finishes. With one job (or one item) nothing starts: ``result()`` computes in this process."""
    items = list(items)
    address = scheduler_address()
    remote = partial(_in_caller_env, _caller_env(), fn)  # fn as a task run in another process
    if address:
        # each task marks its Dask worker as a worker first, so that a sweep inside it runs serially there
        # (as on the process pool) instead of starting a pool in a daemonic process or going back to the cluster
        futures = dask_client(address).map(partial(_as_worker, remote), items, pure=False)
        return Started(fn, items, futures, desc, progress, in_order=True)
    n = jobs if jobs is not None else num_jobs()
    if n <= 1 or len(items) <= 1:
        return Started(fn, items, None, desc, progress)
    pool = process_pool(n)
    return Started(fn, items, [pool.submit(remote, x) for x in items], desc, progress)


class Started:
    """A sweep started by ``pstart``: ``result()`` waits for it and returns ``[fn(x) for x in items]`` in order
    (``futures`` None: computed here, at ``result()``). The bar moves as the pool's tasks finish, or, on a cluster
    (``in_order``), as the head of the sweep completes."""

    def __init__(self, fn: Callable[[Any], Any], items: list, futures: list | None, desc: str | None, progress: bool,
                 in_order: bool = False):
        self._fn, self._items, self._futures, self._in_order = fn, items, futures, in_order
        self._desc, self._progress = desc, progress

    def result(self) -> list:
        bar = tqdm(total=len(self._items), desc=self._desc, disable=not (self._progress and interactive()),
                   leave=False)
        try:
            if self._futures is None:
                out = []
                for x in self._items:
                    out.append(self._fn(x))
                    bar.update(1)
                return out
            for f in (self._futures if self._in_order else as_completed(self._futures)):
                if self._in_order:
                    f.result()
                bar.update(1)
            return [f.result() for f in self._futures]
        finally:
            bar.close()


def call(task: tuple[Callable, tuple, dict]) -> Any:
    """Run one ``(fn, args, kwargs)`` task: ``pmap(call, [(f, args, kw), ...])`` maps over tasks of different
    functions or arguments in one sweep."""
    fn, args, kwargs = task
    return fn(*args, **kwargs)
