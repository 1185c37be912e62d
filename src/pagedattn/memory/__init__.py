"""The paper's memory management (§4.2-§4.5), in pure Python: no torch here, so the same code drives a real model
and a simulation at the paper's scale. ``KVManager`` (``interface.py``) is what the rest of the engine may ask of a KV
manager; ``BlockManager`` (paged) and ``contiguous.ContiguousKVManager`` (Orca) implement it. ``per_sequence`` is the
paged manager's per-sequence view, for the tests and the tour's worked examples."""
from pagedattn.memory.block_pool import BlockPool, NoFreeBlocksError
from pagedattn.memory.block_manager import BlockManager
from pagedattn.memory.interface import AllocStatus, BlockView, KVManager

__all__ = ["AllocStatus", "BlockManager", "BlockView", "BlockPool", "KVManager", "NoFreeBlocksError"]
