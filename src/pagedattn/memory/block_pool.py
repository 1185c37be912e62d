"""Physical KV blocks of one device: a free list and reference counts (paper §4.2, §4.4).

Invariants kept here:
- every block is either free (reference count 0, on the free list exactly once) or used (count >= 1, not on it);
- ``num_free + num_used == num_blocks`` at all times;
- freeing a free block is an error (no double free), so a bug elsewhere cannot hand one block to two requests.
"""
from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """The pool is exhausted right now (the scheduler preempts; this is not a bad request)."""


class BlockPool:
    """``num_blocks`` physical blocks of ``block_size`` token slots on one device ("gpu" or "cpu")."""

    def __init__(self, num_blocks: int, block_size: int, device: str = "gpu") -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.ref_counts = [0] * num_blocks
        # FIFO free list: a freed block goes to the back, so recently used physical ids are not reused at once,
        # which makes block tables visibly non-contiguous, as in the paper's Fig. 6.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        """Take a free block; its reference count becomes 1."""
        if not self._free:
            raise NoFreeBlocksError(f"all {self.num_blocks} {self.device} blocks are in use")
        block = self._free.popleft()
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """One more block table points at ``block`` (fork, §4.4)."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"{self.device} block {block} is free; cannot share it")
        self.ref_counts[block] += 1

    def decref(self, block: int) -> bool:
        """One block table lets go of ``block``; returns True when that freed it."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"double free of {self.device} block {block}")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)
            return True
        return False

    def is_free(self, block: int) -> bool:
        return self.ref_counts[block] == 0
