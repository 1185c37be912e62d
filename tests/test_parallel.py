"""The sweep executor (``pagedattn.repro.sim.parallel``, issue 26): the same results, in the same order, in this process, on a
process pool and on a Dask ``LocalCluster``; and an experiment's ``summary.json`` byte for byte the same whichever
computed it."""
import math
import os
import tempfile
from pathlib import Path

import pytest

from pagedattn.repro.sim import parallel
from pagedattn.repro.experiments import sensitivity
from pagedattn.repro.sim.parallel import call, pmap


@pytest.fixture
def restore_settings():
    yield
    parallel.configure()
    parallel.shutdown()


def _tasks():
    from pagedattn.repro.sim.simulator import simulate  # noqa: F401 (a module-level function, picklable by reference)

    return [(math.sqrt, (x,), {}) for x in range(20)] + [(divmod, (17, k), {}) for k in (1, 2, 3)]


def test_pmap_in_process_and_on_a_pool(restore_settings):
    want = [call(t) for t in _tasks()]
    assert pmap(call, _tasks(), jobs=1) == want
    assert pmap(call, _tasks(), jobs=2) == want  # order kept however the tasks finish
    parallel.configure(jobs=2)
    assert parallel.num_jobs() == 2 and pmap(call, _tasks()) == want


def _cache_one(k: int) -> int:
    return sensitivity.cached({"test_parallel": k}, lambda: k)


def test_tasks_carry_the_callers_settings(monkeypatch, restore_settings, tmp_path):
    """A pool made before the caller changed its ``PAGEDATTN_*`` environment (the sensitivity cache's place, say)
    runs each task with the caller's values, and without a variable the caller no longer has."""
    monkeypatch.delenv("PAGEDATTN_SENSITIVITY_CACHE", raising=False)
    assert pmap(os.getenv, ["PAGEDATTN_SENSITIVITY_CACHE"] * 2, jobs=2) == [None, None]  # the pool starts here
    monkeypatch.setenv("PAGEDATTN_SENSITIVITY_CACHE", str(tmp_path))
    assert pmap(os.getenv, ["PAGEDATTN_SENSITIVITY_CACHE"] * 4, jobs=2) == [str(tmp_path)] * 4
    assert pmap(_cache_one, [1, 2], jobs=2) == [1, 2]  # the workers store in the caller's cache
    assert len(list(tmp_path.glob("*.json"))) == 2
    monkeypatch.delenv("PAGEDATTN_SENSITIVITY_CACHE")
    assert pmap(os.getenv, ["PAGEDATTN_SENSITIVITY_CACHE"] * 4, jobs=2) == [None] * 4


def test_errors_reach_the_caller(restore_settings):
    with pytest.raises(ZeroDivisionError):
        pmap(call, [(divmod, (1, 0), {}), (divmod, (1, 1), {})], jobs=2)
    with pytest.raises(ValueError, match="jobs must be an integer >= 1"):
        parallel.configure(jobs=0)


def test_jobs_from_the_environment(monkeypatch, restore_settings):
    monkeypatch.setenv("PAGEDATTN_JOBS", "3")
    assert parallel.num_jobs() == 3
    monkeypatch.setenv("PAGEDATTN_JOBS", "two")
    with pytest.raises(ValueError, match="PAGEDATTN_JOBS"):
        parallel.num_jobs()
    monkeypatch.setenv(parallel.IN_WORKER, "1")  # a sweep inside a worker runs serially there
    assert parallel.num_jobs() == 1 and parallel.scheduler_address() is None


_points = sensitivity.points


def _summary_bytes(monkeypatch, **settings) -> bytes:
    """09's quick run with three computed sensitivity points (the quick grid computes only one), under
    ``parallel.configure(**settings)``, with a fresh sweep cache: its summary.json."""
    from pagedattn.repro.experiments import chatbot

    grid = _points(quick=True) + [sensitivity.Point(0.5, 0.3, 0.008), sensitivity.Point(0.9, 0.3, 0.004)]
    monkeypatch.setattr(sensitivity, "points", lambda *a, **k: grid)
    monkeypatch.setenv("PAGEDATTN_SENSITIVITY_CACHE", tempfile.mkdtemp())
    parallel.configure(**settings)
    out = Path(tempfile.mkdtemp())
    chatbot.run(quick=True, results_dir=out, progress=False)
    return (out / chatbot.EXPERIMENT / "summary.json").read_bytes()


def test_summary_identical_with_one_job_two_jobs_and_a_cluster(monkeypatch, restore_settings):
    distributed = pytest.importorskip("distributed")
    one = _summary_bytes(monkeypatch, jobs=1)
    assert b"band: holds at all 4 points" in one or b"of 4 points" in one  # four points, three computed
    assert _summary_bytes(monkeypatch, jobs=2) == one
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cl:
        assert _summary_bytes(monkeypatch, scheduler=cl.scheduler_address) == one
        assert pmap(call, _tasks()) == [call(t) for t in _tasks()]
        assert parallel.pstart(call, _tasks()).result() == [call(t) for t in _tasks()]  # started on the cluster
        parallel.shutdown()  # close the client before its cluster goes


def test_real_engine_tasks_build_the_same_model_in_every_worker(restore_settings):
    """A real-engine task builds its model in its worker from the seed (``common.tiny_opt_cached``), not pickled
    from the notebook: every process must get the same weights."""
    import torch

    from pagedattn.repro.experiments.common import tiny_opt, tiny_opt_cached
    from pagedattn.repro.experiments.throughput import TINY_OPT

    want = tiny_opt(0, **TINY_OPT).state_dict()
    for got in pmap(call, [(tiny_opt_cached, (0,), TINY_OPT)] * 2, jobs=2):
        state = got.state_dict()
        assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    assert tiny_opt_cached(0, **TINY_OPT) is tiny_opt_cached(0, **TINY_OPT)


def test_pstart_starts_now_and_collects_in_order(restore_settings):
    """``pstart`` (issue 64): the tasks go to the pool at once, a later ``pmap`` runs meanwhile, and ``result()``
    gives ``[fn(x) for x in items]`` in order, the same in process (one job: computed at ``result()``) and on a
    pool."""
    want = [call(t) for t in _tasks()]
    for jobs in (1, 2):
        parallel.configure(jobs=jobs)
        started = parallel.pstart(call, _tasks())
        assert (started._futures is None) == (jobs == 1)
        assert pmap(call, _tasks()[:3]) == want[:3]
        assert started.result() == want
