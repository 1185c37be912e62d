"""The package's structure (issue 49): no import circles among ``pagedattn``'s modules, imports made only for
annotations (``if TYPE_CHECKING:``) and inside functions included. The layers themselves (research above the entry
points, the entry points above the engine, the engine above its core) are import-linter's contracts in
pyproject.toml, checked by ``make check``."""
import grimp


def circles(graph) -> list[tuple[str, ...]]:
    """Every import ``a -> b`` whose ``b`` reaches back to ``a``, with the chain that closes the circle."""
    found = []
    for a in sorted(graph.modules):
        for b in sorted(graph.find_modules_directly_imported_by(a)):
            if b.startswith("pagedattn") and graph.chain_exists(importer=b, imported=a):
                found.append((a, *graph.find_shortest_chain(importer=b, imported=a)))
    return found


def test_no_import_circles():
    graph = grimp.build_graph("pagedattn", exclude_type_checking_imports=False)
    assert "pagedattn.core" in graph.modules and "pagedattn.repro.sim.simulator" in graph.modules
    assert not circles(graph), "import circles (each: a module, then the chain back to it)"


def test_the_check_sees_a_circle():
    graph = grimp.build_graph("pagedattn", exclude_type_checking_imports=False)
    graph.add_import(importer="pagedattn.memory.interface", imported="pagedattn.repro.sim.simulator")
    assert any(c[0] == "pagedattn.memory.interface" and c[-1] == "pagedattn.memory.interface" for c in circles(graph))


def test_the_engine_core_knows_no_runs_of_steady_steps():
    """The simulator's fast path is the research tier's (``repro.sim.runs``, issue 63): the core's ``Executor`` is
    ``execute`` alone, the scheduler and the KV allocator view carry no run methods (the managers implement them
    as ``KVDecodeRuns``, an extension only the simulator uses), and ``EngineCore.step`` is the base of the
    simulator's ``RunCore``."""
    from pagedattn.core import EngineCore, Executor
    from pagedattn.memory.interface import KVAllocator, KVDecodeRuns
    from pagedattn.repro.sim.runs import RunCore
    from pagedattn.scheduler import Scheduler

    def public(cls) -> set[str]:
        return {n for n in dir(cls) if not n.startswith("_")}

    assert public(Executor) == {"execute"}
    assert not public(Scheduler) & {"steady_decode_steps", "advance", "schedule_steady", "running_seqs"}
    assert not public(KVAllocator) & public(KVDecodeRuns) and public(KVDecodeRuns) == {"decode_room", "advance"}
    assert RunCore.step is not EngineCore.step and issubclass(RunCore, EngineCore)


def test_one_registry_of_systems():
    """One ``SYSTEMS`` registry in ``src/`` (issue 63): ``memory.systems.SYSTEMS`` (name, label, manager factory,
    static batching). An experiment names the systems it compares (``COMPARED``) from it; no other module defines a
    module-level ``SYSTEMS``."""
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "pagedattn"
    defines = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            if any(isinstance(t, ast.Name) and t.id == "SYSTEMS" for t in targets):
                defines.append(path.relative_to(src).as_posix())
    assert defines == ["memory/systems.py"]
