"""The paper's memory management (§4.2-§4.5), in pure Python: no torch here, so the same code drives a real model
and a simulation at the paper's scale."""
from pagedattn.memory.block_pool import BlockPool, NoFreeBlocksError
from pagedattn.memory.block_manager import AllocStatus, BlockManager

__all__ = ["AllocStatus", "BlockManager", "BlockPool", "NoFreeBlocksError"]
