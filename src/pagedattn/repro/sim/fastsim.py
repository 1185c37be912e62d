"""The simulator compiled with mypyc: the same source, run about twice as fast (issue 26).

A paper-scale replay (``sim.simulate``) spends its time in the interpreter, in the scheduler's and the KV managers'
per-step bookkeeping; tuning that Python further moved it by no more than the noise. So the modules a replay runs
(``MODULES``: the configuration, the sequences, the scheduler, the engine core, the block pool, the paged and
contiguous KV managers, their accounting and registry, the simulator's runs and the simulator) are copied under another package name, ``pagedattn_fastsim``
(``copy_source``, the build's one declared step on the sources: their imports of each other, found by ``ast``, point
at the copy, and nothing else changes; ``tests/test_fastsim.py`` checks the copy against the sources), and compiled with mypyc (pinned with mypy in
requirements-dev.txt) into ``.build/fastsim/`` (git-ignored): ``python -m pagedattn.repro.sim.fastsim`` (``make
fastsim``; ``make reproduce`` builds it first). The copy is a package of its own, so the real engine, the tests'
monkeypatches and every object outside a replay keep the interpreted modules.

``sim.simulate`` hands a replay to the compiled copy (``replay``) only when all of these hold, and otherwise runs the
interpreted simulator:

- the build is present, was made by this Python with ``RECIPE``, and the digests of the sources it was compiled from
  equal the sources now (a stale build is never used: after any edit, replays are interpreted until it is rebuilt);
- the replay's step-time and beam models are plain ``CostModel`` / ``BeamModel`` instances (a subclass, such as
  notebook 13's fitted step time, overrides methods the copy does not have) that convert to the copy's;
- ``PAGEDATTN_FASTSIM`` is not ``0``.

A compiled replay returns the same ``SimResult`` as an interpreted one, value for value: the golden digests
(``tests/test_sim_golden.py``) run on both, and ``tests/test_fastsim.py`` compares the two on random traces. mypyc
checks argument types at run time; a replay that the copy refuses with a ``TypeError`` (say, a numpy integer where
the source says ``int``) is rerun interpreted, with a warning.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import types
import warnings
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, TypeVar

SRC = Path(__file__).resolve().parents[3]  # .../src
BUILD_DIR = SRC.parent / ".build" / "fastsim"
PACKAGE = "pagedattn_fastsim"
#: module -> its name in the copy: what a replay runs, in import order
MODULES = {"pagedattn.config": "config", "pagedattn.sequence": "sequence", "pagedattn.memory.accounting": "accounting",
           "pagedattn.memory.block_pool": "block_pool",
           "pagedattn.memory.block_manager": "block_manager", "pagedattn.memory.contiguous": "contiguous",
           "pagedattn.memory.systems": "systems", "pagedattn.scheduler": "scheduler", "pagedattn.core": "core",
           "pagedattn.repro.sim.runs": "runs", "pagedattn.repro.sim.simulator": "sim"}
MANIFEST = "manifest.json"
ENV = "PAGEDATTN_FASTSIM"
# mypyc's flags. "skip": the copied modules' imports of the rest of pagedattn (and of torch, numpy) are typed Any
# instead of being parsed and checked; that cut the build from about 300 s to 31 s on two cores, and replays ran as
# fast as with "silent" (0.83-1.13x across repeated pairs). A build made with other flags counts as stale.
RECIPE = ("--follow-imports=skip", "--ignore-missing-imports")


def _source(module: str) -> Path:
    return SRC.joinpath(*module.split(".")).with_suffix(".py")


def _digests() -> dict[str, str]:
    return {m: hashlib.sha256(_source(m).read_bytes()).hexdigest() for m in MODULES}


def _python_tag() -> str:
    return f"{sys.implementation.cache_tag}-{sysconfig.get_platform()}"


def copy_source(module: str) -> str:
    """The build's one step on the sources (the copy ``build`` compiles, which ``tests/test_fastsim.py`` checks
    against them): ``module``'s source with each ``from <copied module> import ...`` statement, found by ``ast``,
    pointed at the copy (``from pagedattn_fastsim.<name> import ...``). Every other character is the source's;
    another form of import of a copied module (``import pagedattn.scheduler``, a relative import) is refused, as
    the copy could not follow it."""
    text = _source(module).read_text()
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    edits = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
            assert node.end_lineno is not None and node.end_col_offset is not None
            edits.append((starts[node.lineno - 1] + node.col_offset, starts[node.end_lineno - 1] + node.end_col_offset,
                          ast.unparse(ast.ImportFrom(f"{PACKAGE}.{MODULES[node.module]}", node.names, 0))))
        elif isinstance(node, ast.Import) and any(a.name in MODULES for a in node.names) or \
                isinstance(node, ast.ImportFrom) and node.level > 0:
            raise ValueError(f"{module}:{node.lineno}: only `from <module> import ...` of a copied module can be "
                             "pointed at the compiled copy")
    for start, end, statement in sorted(edits, reverse=True):  # (import lines are ASCII: offsets are characters)
        text = text[:start] + statement + text[end:]
    return text


def build(quiet: bool = False) -> Path:
    """Copy ``MODULES`` into ``pagedattn_fastsim`` and compile them with mypyc into ``BUILD_DIR`` (about half a minute
    on two cores); the manifest records the sources' digests, this Python and ``RECIPE``. Raises if mypyc fails."""
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / PACKAGE
        pkg.mkdir()
        (pkg / "__init__.py").write_text('"""Compiled copy of the simulator\'s modules (pagedattn.repro.sim.fastsim)."""\n')
        digests = _digests()
        for module, name in MODULES.items():
            (pkg / f"{name}.py").write_text(copy_source(module))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, str(SRC)]), "MYPYPATH": str(SRC)}
        cmd = [sys.executable, "-m", "mypyc", *RECIPE, *[f"{PACKAGE}/{name}.py" for name in MODULES.values()]]
        done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=quiet, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"mypyc failed ({done.returncode}):\n{(done.stdout or '')[-3000:]}"
                               f"{(done.stderr or '')[-3000:]}")
        if BUILD_DIR.exists():
            shutil.rmtree(BUILD_DIR)
        (BUILD_DIR / PACKAGE).mkdir(parents=True)
        for f in Path(tmp).glob("*.so"):  # mypyc's shared library of the group
            shutil.copy2(f, BUILD_DIR / f.name)
        for f in [*pkg.glob("*.so"), *pkg.glob("*.py")]:
            shutil.copy2(f, BUILD_DIR / PACKAGE / f.name)
        (BUILD_DIR / MANIFEST).write_text(json.dumps({"python": _python_tag(), "recipe": list(RECIPE),
                                                          "sources": digests}, indent=1))
    status.cache_clear()
    return BUILD_DIR


@lru_cache(maxsize=1)
def status() -> tuple[ModuleType | None, str]:
    """The compiled ``sim`` module and "ok", or None and why it is not used (absent, stale, other Python, off)."""
    if os.environ.get(ENV, "1") == "0":
        return None, f"{ENV}=0"
    manifest = BUILD_DIR / MANIFEST
    if not manifest.exists():
        return None, f"not built ({BUILD_DIR}; python -m pagedattn.repro.sim.fastsim)"
    record = json.loads(manifest.read_text())
    if record.get("python") != _python_tag():
        return None, f"built for {record.get('python')}, this is {_python_tag()}"
    if record.get("recipe") != list(RECIPE):
        return None, f"built with mypyc flags {record.get('recipe')}, the recipe is now {list(RECIPE)}"
    stale = sorted(m for m, d in _digests().items() if record.get("sources", {}).get(m) != d)
    if stale:
        return None, f"stale: {', '.join(stale)} changed since the build (python -m pagedattn.repro.sim.fastsim)"
    if str(BUILD_DIR) not in sys.path:
        sys.path.insert(0, str(BUILD_DIR))
    try:
        module = importlib.import_module(f"{PACKAGE}.sim")
    except ImportError as e:
        return None, f"cannot import the build: {e}"
    if not str(getattr(module, "__file__", "")).endswith((".so", ".pyd")):
        return None, "the build holds no compiled module"
    return module, "ok"


def _convert(value: Any, cls: type) -> Any:
    """A plain dataclass instance of the interpreted ``sim`` as the same instance of the copy's class ``cls``."""
    return cls(**{f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init})


def replay(args: dict[str, Any], sim: Any) -> Any | None:
    """``sim.simulate``'s replay by the compiled copy, given its arguments by name and the interpreted ``sim``
    module's namespace (its classes: this module does not import it, which imports this one); None where the copy
    cannot take it (``status``, or a subclass of ``CostModel`` / ``BeamModel``), and the caller replays it
    interpreted."""
    fast, _ = status()
    if fast is None:
        return None
    cost, beam = args.get("cost"), args.get("beam")
    if (cost is not None and type(cost) is not sim.CostModel) or (beam is not None and type(beam) is not sim.BeamModel):
        return None
    try:
        kw = {**args, "cost": _convert(cost, fast.CostModel) if cost is not None else None,
              "beam": _convert(beam, fast.BeamModel) if beam is not None else None}
        r = fast.simulate(**kw)
    except TypeError as e:  # mypyc's run-time type check of an argument the source's annotations do not name
        warnings.warn(f"compiled simulator refused a replay ({e}); replaying it interpreted", stacklevel=3)
        return None
    return sim.SimResult(r.system, r.steps, r.requests, r.num_preemptions, r.prefix_hit_rate,
                         r.prefill_tokens_computed, r.steps_in_runs)


F = TypeVar("F", bound=Callable[..., Any])


def compiled_when_built(simulate: F) -> F:
    """``sim.simulate``'s decorator: the interpreted module's ``simulate`` replays through the compiled copy when it
    can (``replay``); the copy's own ``simulate`` (the same source, compiled) runs itself."""
    if simulate.__module__ != "pagedattn.repro.sim.simulator":
        return simulate
    signature = inspect.signature(simulate)
    sim = types.SimpleNamespace(**{k: simulate.__globals__.get(k) for k in ("CostModel", "BeamModel", "SimResult")})

    @functools.wraps(simulate)
    def dispatch(*args, **kwargs):
        r = replay(signature.bind(*args, **kwargs).arguments, sim)
        return r if r is not None else simulate(*args, **kwargs)
    return dispatch  # type: ignore[return-value]


if __name__ == "__main__":
    if "--if-stale" in sys.argv and status()[0] is not None:
        print(f"compiled simulator up to date: {BUILD_DIR}")
        sys.exit(0)
    print(f"compiling the simulator with mypyc into {BUILD_DIR} (about half a minute)", flush=True)
    path = build(quiet=True)
    module, why = status()
    print(f"built {path}: {why}")
    sys.exit(0 if module is not None else 1)
