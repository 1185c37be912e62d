"""The compiled simulator (``pagedattn.repro.sim.fastsim``): when it is used, and that it replays exactly as the interpreted
one (the golden digests run on both paths too: ``tests/test_sim_golden.py``)."""
from __future__ import annotations

import ast
import json

import pytest
from hypothesis import given, settings, strategies as st

from pagedattn.repro.sim import fastsim
from pagedattn.repro.sim import simulator as sim
from pagedattn.repro.sim.simulator import BeamModel, CostModel, simulate
from pagedattn.repro.workloads.traces import TraceRequest

from test_sim_golden import digest


@pytest.fixture
def fresh_status():
    fastsim.status.cache_clear()
    yield
    fastsim.status.cache_clear()


def built() -> bool:
    return fastsim.status()[0] is not None


def _pointed_back(tree: ast.AST) -> ast.AST:
    """A copy's syntax tree with its imports of the copy pointed back at the copied modules."""
    real = {f"{fastsim.PACKAGE}.{name}": module for module, name in fastsim.MODULES.items()}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in real:
            node.module = real[node.module]
    return tree


def test_the_copy_is_the_sources_with_their_imports_of_each_other_pointed_at_it():
    """The compiled copy (``fastsim.copy_source``, the build's one step on the sources) is every copied module's
    source, statement for statement, but for its imports of the other copied modules, which name the copy; where
    a build is present, its sources are that copy of today's sources."""
    for module, name in fastsim.MODULES.items():
        source, copy = fastsim._source(module).read_text(), fastsim.copy_source(module)
        assert ast.dump(_pointed_back(ast.parse(copy))) == ast.dump(ast.parse(source)), module
        changed = [line for line in copy.splitlines() if line not in source.splitlines()]
        assert all(line.lstrip().startswith(f"from {fastsim.PACKAGE}.") for line in changed), changed
        assert changed or module in ("pagedattn.config", "pagedattn.sequence", "pagedattn.memory.accounting",
                                     "pagedattn.memory.block_pool"), module  # (none of theirs)
        if built():
            assert (fastsim.BUILD_DIR / fastsim.PACKAGE / f"{name}.py").read_text() == copy, module


def test_the_copy_refuses_an_import_it_could_not_follow(tmp_path, monkeypatch):
    path = tmp_path / "m.py"
    monkeypatch.setattr(fastsim, "_source", lambda module: path)
    path.write_text("from pagedattn.memory.interface import num_copied\nfrom pagedattn.scheduler import (\n"
                    "    Scheduler,\n    SchedulerOutputs)  # the scheduler\n")
    assert fastsim.copy_source("m") == ("from pagedattn.memory.interface import num_copied\n"
                                        f"from {fastsim.PACKAGE}.scheduler import Scheduler, SchedulerOutputs"
                                        "  # the scheduler\n")
    path.write_text("import pagedattn.scheduler\n")
    with pytest.raises(ValueError, match="only `from <module> import ...`"):
        fastsim.copy_source("m")


def _manifest(tmp_path, **kw):
    record = {"python": fastsim._python_tag(), "recipe": list(fastsim.RECIPE), "sources": fastsim._digests(), **kw}
    (tmp_path / fastsim.MANIFEST).write_text(json.dumps(record))


def test_a_missing_stale_or_foreign_build_is_not_used(tmp_path, monkeypatch, fresh_status):
    monkeypatch.setattr(fastsim, "BUILD_DIR", tmp_path)
    assert fastsim.status()[0] is None and "not built" in fastsim.status()[1]
    sources = fastsim._digests()
    _manifest(tmp_path, sources={**sources, "pagedattn.scheduler": "0" * 64})
    fastsim.status.cache_clear()
    module, why = fastsim.status()
    assert module is None and why.startswith("stale: pagedattn.scheduler")
    _manifest(tmp_path, python="cpython-39-elsewhere")
    fastsim.status.cache_clear()
    assert fastsim.status()[0] is None and "built for cpython-39-elsewhere" in fastsim.status()[1]
    _manifest(tmp_path, recipe=["--follow-imports=silent"])  # another mypyc recipe: rebuilt, never used
    fastsim.status.cache_clear()
    assert fastsim.status()[0] is None and "built with mypyc flags ['--follow-imports=silent']" in fastsim.status()[1]
    monkeypatch.setenv(fastsim.ENV, "0")
    fastsim.status.cache_clear()
    assert fastsim.status() == (None, f"{fastsim.ENV}=0")
    trace = [TraceRequest("a", 0.0, 20, 5)]
    assert fastsim.replay({"trace": trace}, sim) is None
    assert simulate(trace, "paged", 640).requests.finish_time.notna().all()  # interpreted


needs_build = pytest.mark.skipif(not built(), reason=f"no compiled simulator: {fastsim.status()[1]}")


@needs_build
def test_replays_go_to_the_compiled_copy_unless_a_model_is_a_subclass():
    trace = [TraceRequest(f"r{i}", 0.1 * i, 30 + i, 20) for i in range(10)]
    assert fastsim.replay({"trace": trace, "system": "paged", "num_slots": 2000}, sim) is not None

    class Slower(CostModel):
        def decode_time(self, num_seqs: int, context_tokens: int) -> float:
            return 2 * super().decode_time(num_seqs, context_tokens)

    assert fastsim.replay({"trace": trace, "cost": Slower()}, sim) is None
    assert fastsim.replay({"trace": trace, "cost": CostModel(step_overhead_s=0.01)}, sim) is not None


def _both(trace, **kw):
    """The interpreted and the compiled replay of the same arguments."""
    status = fastsim.status
    try:
        fastsim.status = lambda: (None, "interpreted by the test")
        slow = simulate(trace, **kw)
    finally:
        fastsim.status = status
    fast = fastsim.replay({"trace": trace, **kw}, sim)
    assert fast is not None
    return slow, fast


@needs_build
@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 200), st.floats(0, 3)), min_size=1, max_size=40),
       system=st.sampled_from(["paged", "orca_max", "orca_pow2", "orca_oracle", "ft"]),
       slots=st.integers(600, 4000), mode=st.sampled_from(["recompute", "swap"]), n=st.integers(1, 3),
       beam=st.sampled_from([None, 2, 4]), seed=st.integers(0, 5))
def test_compiled_replay_equals_interpreted_on_random_traces(lens, system, slots, mode, n, beam, seed):
    trace = [TraceRequest(f"r{i}", t, p, o) for i, (p, o, t) in enumerate(lens)]
    kw = dict(system=system, num_slots=slots, preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0,
              n=n, seed=seed, max_model_len=512, beam=BeamModel.measured(beam) if beam and system == "paged" else None,
              cost=CostModel(step_overhead_s=0.002))
    slow, fast = _both(trace, **kw)
    assert digest(fast) == digest(slow)


@needs_build
def test_compiled_replay_of_an_offline_trace_with_prefix_caching():
    trace = [TraceRequest(f"r{i}", 0.0, 48, 10 + i) for i in range(30)]
    prompts = {r.request_id: [7] * 32 + [i + 1] * 16 for i, r in enumerate(trace)}
    slow, fast = _both(trace, system="paged", num_slots=1200, prompts=prompts, enable_prefix_caching=True)
    assert slow.prefix_hit_rate > 0.4
    assert digest(fast) == digest(slow)
