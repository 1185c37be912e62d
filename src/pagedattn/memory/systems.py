"""The serving systems the paper compares (§6.1), as KV managers over one budget of token slots: the one mapping from
a system's name to its manager, for the real engine (``EngineArgs.kv_manager``) and the simulator alike.

- ``paged``: vLLM's block tables over fixed-size blocks (§4.2-§4.5; ``BlockManager``);
- ``orca_max`` / ``orca_pow2`` / ``orca_oracle``: Orca's contiguous reservation of the maximum length, the next
  power of two of the output, or the true output (§6.1; ``ContiguousKVManager``, block size 1);
- ``static``: FasterTransformer-style static batching (Fig. 12's ``ft``) over Orca (Max)'s reservation: a batch starts
  only when the previous one has finished (``SchedulerConfig.static_batching``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, cast

from pagedattn.memory.block_manager import BlockManager
from pagedattn.memory.contiguous import ContiguousKVManager, Policy
from pagedattn.memory.interface import KVManager

#: ``System.make``'s signature: ``(num_slots, block_size, max_model_len, num_cpu_blocks, watermark, placement,
#: enable_prefix_caching)`` -> the KV manager
ManagerFactory = Callable[[int, int, int, int, float, str, bool], KVManager]


def _paged(num_slots: int, block_size: int, max_model_len: int, num_cpu_blocks: int, watermark: float,
           placement: str, enable_prefix_caching: bool) -> KVManager:
    return BlockManager(block_size, num_slots // block_size, num_cpu_blocks, watermark, max_model_len,
                        enable_prefix_caching)


def _contiguous(policy: Policy) -> ManagerFactory:
    def make(num_slots: int, block_size: int, max_model_len: int, num_cpu_blocks: int, watermark: float,
             placement: str, enable_prefix_caching: bool) -> KVManager:
        return ContiguousKVManager(num_slots, policy, max_model_len, cast(Literal["buddy", "exact"], placement))
    return make


@dataclass(frozen=True)
class System:
    """One serving system of the comparison: its name, the label the paper's figures give it, the factory of its
    KV manager and whether it batches statically (no request joins a running batch)."""

    name: str
    label: str
    make: ManagerFactory
    static_batching: bool = False


#: The registry: every system by name, in the paper's figures' order (Orca's three, then ours); ``ft`` is
#: ``static`` under the name the paper's figures give it.
SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("orca_max", "Orca (Max)", _contiguous("max")),
    System("orca_pow2", "Orca (Pow2)", _contiguous("pow2")),
    System("orca_oracle", "Orca (Oracle)", _contiguous("oracle")),
    System("paged", "vLLM (ours)", _paged),
    System("static", "FasterTransformer", _contiguous("max"), static_batching=True),
    System("ft", "FasterTransformer", _contiguous("max"), static_batching=True),
)}
#: the systems that batch at the iteration level: Fig. 2's and Fig. 12's Orca and ours
ITERATION_LEVEL: tuple[str, ...] = tuple(name for name, s in SYSTEMS.items() if not s.static_batching)
#: every system's label (the figures' legends)
LABELS: dict[str, str] = {name: s.label for name, s in SYSTEMS.items()}


def system(name: str) -> System:
    """The registry's entry of ``name``; raises naming the known systems."""
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; known: {list(SYSTEMS)}")
    return SYSTEMS[name]


def engine_system(name: str) -> tuple[str, bool]:
    """An experiment's or the server's system name as ``EngineArgs``' ``(kv_manager, enable_prefix_caching)``:
    ``paged_user`` (user-marked shared prefixes) and ``paged_auto`` (automatic prefix caching, §4.4) are the paged
    manager, the latter with its prefix cache on; ``ft`` is ``static``; the others are themselves."""
    kv_manager = "paged" if name.startswith("paged") else "static" if name == "ft" else name
    return kv_manager, name == "paged_auto"


def make_kv_manager(system_name: str, num_slots: int, block_size: int = 16, max_model_len: int = 2048,
                    num_cpu_blocks: int = 0, watermark: float = 0.01, placement: str = "buddy",
                    enable_prefix_caching: bool = False) -> KVManager:
    """The KV manager of ``system_name`` over ``num_slots`` token slots (paged: ``num_slots // block_size``
    blocks). ``num_cpu_blocks`` (the swap space) and ``enable_prefix_caching`` are the paged manager's: a contiguous
    reservation has no CPU pool (its preempted requests are recomputed) and shares no blocks."""
    return system(system_name).make(num_slots, block_size, max_model_len, num_cpu_blocks, watermark, placement,
                                    enable_prefix_caching)
