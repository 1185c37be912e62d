"""The builders the tests construct KV managers, schedulers and engines with (one place each, as vLLM's tests build
theirs in ``tests/v1/core/utils.py``, e.g. ``create_scheduler``), with the defaults the tests use most. A test passes
explicitly every argument its meaning depends on. Sequence groups are built by ``seq_groups``, tiny models by
``tiny_models``. Imported by test modules (``from factories import block_manager``); not a test module. Importing it
imports no torch."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pagedattn.config import SchedulerConfig
from pagedattn.memory.block_manager import BlockManager
from pagedattn.memory.contiguous import ContiguousKVManager, Policy
from pagedattn.memory.interface import KVManager
from pagedattn.scheduler import Scheduler

if TYPE_CHECKING:
    from pagedattn.engine import LLMEngine


def block_manager(block_size: int = 4, num_gpu_blocks: int = 8, num_cpu_blocks: int = 0, watermark: float = 0.0,
                  max_model_len: int | None = None, enable_prefix_caching: bool = False) -> BlockManager:
    """A paged KV manager (§4.2-§4.5): ``num_gpu_blocks`` device blocks of ``block_size`` slots, ``num_cpu_blocks``
    of swap space. Unlike ``BlockManager``'s own default (1 %), no blocks are kept free at admission unless a
    ``watermark`` is given: in the pools of a few blocks the tests use, 1 % is no block anyway."""
    return BlockManager(block_size, num_gpu_blocks, num_cpu_blocks, watermark, max_model_len, enable_prefix_caching)


def contiguous_manager(arena_slots: int = 64, policy: Policy = "oracle", max_model_len: int = 2048,
                       placement: Literal["buddy", "exact"] = "buddy") -> ContiguousKVManager:
    """An Orca KV manager (§6.1): one contiguous reservation per sequence in an arena of ``arena_slots`` slots."""
    return ContiguousKVManager(arena_slots, policy, max_model_len, placement)


def scheduler(kv: KVManager, static_batching: bool = False, **config: Any) -> Scheduler:
    """The scheduler (§4.5) over the KV manager ``kv``, configured by ``SchedulerConfig(**config)``."""
    return Scheduler(SchedulerConfig(**config), kv, static_batching=static_batching)


def llm_engine(model=None, **args: Any) -> LLMEngine:
    """The real engine, with ``LLMEngine``'s arguments, on ``model``: by default the tiny random-weight OPT of
    ``tiny_models`` (a test that depends on the model passes its own)."""
    from pagedattn.engine import LLMEngine  # torch and transformers: imported only by the tests that run a model
    from tiny_models import tiny_opt

    return LLMEngine(tiny_opt() if model is None else model, **args)
