"""Physical KV blocks of one device: a free list, reference counts and a prefix cache (paper §4.2, §4.4).

Invariants kept here:
- every block is either used (reference count >= 1) or free (count 0); a free block sits either on the plain free
  list or, when it still holds the K/V of a known token prefix, on the *evictable* list (prefix caching);
- ``num_free + num_used == num_blocks`` at all times;
- freeing a free block is an error (no double free), so a bug elsewhere cannot hand one block to two requests;
- ``cached[h] == b`` exactly when ``block_hash[b] == h``; only a block with reference count 0 is ever evicted, the
  least recently freed first.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from pagedattn.memory.interface import NoFreeBlocksError

__all__ = ["BlockPool", "NoFreeBlocksError"]


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
        # Prefix cache: digest of (prefix, block tokens) <-> block; free cached blocks wait in LRU order. The CPU pool
        # keeps one too, so that a block shared by several swapped-out groups is copied and held once (§4.5).
        self.cached: dict[bytes, int] = {}
        self.block_hash: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def free_order(self) -> list[int]:
        """The free blocks in the order ``allocate`` takes them: the uncached ones first in, first out, then the
        cached ones, least recently freed first."""
        return [*self._free, *self._evictable]

    def allocate(self) -> int:
        """Take a free block (an uncached one first, else evict the least recently used cached one); count 1."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self.cached[self.block_hash.pop(block)]
            self.num_evictions += 1
        else:
            raise NoFreeBlocksError(f"all {self.num_blocks} {self.device} blocks are in use")
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
            if block in self.block_hash:
                self._evictable[block] = None  # keeps its K/V until evicted
            else:
                self._free.append(block)
            return True
        return False

    # ------------------------------------------------------------------------------------------ prefix cache
    def lookup(self, h: bytes | None) -> int | None:
        """The block caching prefix digest ``h``, if any (None: a block without a digest, never cached)."""
        return self.cached.get(h) if h is not None else None

    def touch(self, block: int) -> None:
        """A new request reuses a cached block: revive it from the evictable list, or share it."""
        if self.ref_counts[block] == 0:
            del self._evictable[block]
            self.ref_counts[block] = 1
        else:
            self.incref(block)

    def register(self, block: int, h: bytes) -> None:
        """Remember that ``block`` holds the full block of tokens whose prefix digest is ``h`` (first writer wins)."""
        if h not in self.cached and block not in self.block_hash:
            self.cached[h] = block
            self.block_hash[block] = h

    def check(self) -> None:
        free = list(self._free)
        assert len(free) == len(set(free)), f"{self.device} free list holds a block twice"
        assert not set(free) & set(self._evictable), f"{self.device} block both free and evictable"
        assert all(self.ref_counts[b] == 0 for b in free + list(self._evictable)), "a used block is free"
        assert all(b in self.block_hash for b in self._evictable), "an evictable block has no hash"
        assert all(b not in self.block_hash for b in free), "a plain free block still has a hash"
        assert {b: h for h, b in self.cached.items()} == self.block_hash, "prefix cache maps disagree"
        assert self.num_free + sum(1 for c in self.ref_counts if c > 0) == self.num_blocks
