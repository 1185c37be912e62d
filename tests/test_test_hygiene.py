"""The tests' own conventions (issue 49): a test reads a KV manager's state only through its inspector
(``memory.interface.KVInspector``: ``pool_counts``, ``block_view``, ``seq_ids``, ``location``, ``num_tokens``,
``block_table``, ``stats``...), never its pools, tables or counters, so that the managers may change inside without
breaking the tests; and it builds KV managers, schedulers and engines through ``tests/factories.py``.

The allocators' own unit tests (``BlockPool``, ``BuddyAllocator``) test those classes directly; they are the unit under
test, not reaches from outside. A line that corrupts a manager's state on purpose, to check that ``check_invariants``
names what broke, says so (``corrupted on purpose``)."""
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
ON_PURPOSE = "corrupted on purpose"

#: reaches into a KV manager's inside: its pools (``kv.gpu``, ``kv.cpu``, ``kv._pool(...)``, a contiguous manager's
#: ``arena``), its tables and counters, and the pools' private lists
PRIVATE = [
    r"\._pool\(",
    r"\.(gpu|cpu|arena)\.",
    r"\._(free|evictable)\b",
    # the manager's tables, pinned blocks and prefix counters, on a manager as the tests name one (``kv``, ``m``,
    # ``paged``, ``orca``, ``e.kv``, ``self.m``...): a ``BlockView`` or ``PoolCounts`` has fields of these names,
    # and they are its to read
    r"(?:(?<![\w.])(?:kv|m|paged|orca|unbounded|manager)|\.kv|\.m)\.(tables|pinned|prefix_hits|prefix_queries)\b",
]
#: constructors that only ``factories.py`` calls (a test of a class's own defaults says so on its line)
BUILT = r"(?<![\w.])(BlockManager|ContiguousKVManager|Scheduler|LLMEngine)\("
#: test modules whose unit under test is a constructor itself (``LLMEngine``'s keywords are ``EngineArgs``' fields)
CONSTRUCTOR_TESTS = {"test_engine_args.py"}


def offending(pattern: str, exempt: str, skip: set[str] = frozenset()) -> list[str]:
    found = []
    for path in sorted(TESTS.glob("*.py")):
        if path.name in skip | {Path(__file__).name, "factories.py"}:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0] if not line.lstrip().startswith(('"', "'")) else ""
            code = re.sub(r'"[^"]*"|\'[^\']*\'', '""', code)  # names inside strings (claim names) are no reaches
            if re.search(pattern, code) and exempt not in line:
                found.append(f"{path.name}:{i}: {line.strip()}")
    return found


@pytest.mark.parametrize("pattern", PRIVATE)
def test_no_test_reads_a_kv_managers_private_state(pattern):
    assert offending(pattern, ON_PURPOSE) == []


def test_the_private_patterns_catch_what_they_name():
    for reach in ("kv._pool(t.device)", "kv.gpu.ref_counts", "m.cpu.num_free", "m.arena.num_free", "kv.tables",
                  "e.kv.pinned", "kv.prefix_hits", "self.m.prefix_queries", "p._free.remove(1)"):
        assert any(re.search(p, reach) for p in PRIVATE), reach
    for inspected in ("view.tables", "kv.block_view().pinned", "counts.prefix_hits", "c.prefix_hits",
                      "kv.pool_counts().prefix_hits", "kv.block_view(\"gpu\").tables", "frame.cpu_blocks"):
        assert not any(re.search(p, inspected) for p in PRIVATE), inspected
    assert re.search(BUILT, "kv = BlockManager(4, 8)") and re.search(BUILT, "Scheduler(SchedulerConfig(), kv)")
    assert not re.search(BUILT, "kv = block_manager(4, 8)") and not re.search(BUILT, "pagedattn.memory.BlockManager(")


def test_tests_build_managers_schedulers_and_engines_through_the_factories():
    assert offending(BUILT, "own defaults are under test", CONSTRUCTOR_TESTS) == []
