"""The serving systems the paper compares (§6.1), as KV managers over one budget of token slots: the one mapping from
a system's name to its manager, for the real engine (``EngineArgs.kv_manager``) and the simulator alike.

- ``paged``: vLLM's block tables over fixed-size blocks (§4.2-§4.5; ``BlockManager``);
- ``orca_max`` / ``orca_pow2`` / ``orca_oracle``: Orca's contiguous reservation of the maximum length, the next
  power of two of the output, or the true output (§6.1; ``ContiguousKVManager``, block size 1);
- ``static``: FasterTransformer-style static batching (Fig. 12's ``ft``) over Orca (Max)'s reservation: a batch starts
  only when the previous one has finished (``SchedulerConfig.static_batching``).
"""
from __future__ import annotations

from typing import Literal, cast

from pagedattn.memory.block_manager import BlockManager
from pagedattn.memory.contiguous import ContiguousKVManager, Policy
from pagedattn.memory.interface import KVManager

#: every system's name; ``ft`` is ``static`` under the name the paper's figures give it
SYSTEMS: tuple[str, ...] = ("paged", "orca_max", "orca_pow2", "orca_oracle", "static", "ft")


def engine_system(name: str) -> tuple[str, bool]:
    """An experiment's or the server's system name as ``EngineArgs``' ``(kv_manager, enable_prefix_caching)``:
    ``paged_user`` (user-marked shared prefixes) and ``paged_auto`` (automatic prefix caching, §4.4) are the paged
    manager, the latter with its prefix cache on; ``ft`` is ``static``; the others are themselves."""
    kv_manager = "paged" if name.startswith("paged") else "static" if name == "ft" else name
    return kv_manager, name == "paged_auto"


def is_static(system: str) -> bool:
    """Whether ``system`` batches statically (no request joins a running batch)."""
    return system in ("static", "ft")


def make_kv_manager(system: str, num_slots: int, block_size: int = 16, max_model_len: int = 2048,
                    num_cpu_blocks: int = 0, watermark: float = 0.01, placement: str = "buddy",
                    enable_prefix_caching: bool = False) -> KVManager:
    """The KV manager of ``system`` over ``num_slots`` token slots (paged: ``num_slots // block_size`` blocks).
    ``num_cpu_blocks`` (the swap space) and ``enable_prefix_caching`` are the paged manager's: a contiguous
    reservation has no CPU pool (its preempted requests are recomputed) and shares no blocks."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; known: {list(SYSTEMS)}")
    if system == "paged":
        return BlockManager(block_size, num_slots // block_size, num_cpu_blocks, watermark, max_model_len,
                            enable_prefix_caching)
    policy = "max" if is_static(system) else system.removeprefix("orca_")
    return ContiguousKVManager(num_slots, cast(Policy, policy), max_model_len, cast(Literal["buddy", "exact"], placement))
