"""Block tables over a pool of physical KV blocks (paper §4.2-§4.5).

Each sequence owns a *block table*: its logical blocks, in order, mapped to physical block ids. Blocks are allocated
on demand (a new one only when the last one is full), so a sequence wastes less than one block. ``fork`` lets a
child share all of its parent's blocks (reference counts go up, nothing is copied); an append to a shared block
triggers *copy-on-write*: the writer gets a fresh block and the manager returns the ``(src, dst)`` copy for the
executor to perform (§4.4). Preemption moves a sequence group's blocks to a CPU pool and back (``swap_out`` /
``swap_in``) or frees them for recomputation (§4.5).

Invariants (checked by ``check_invariants`` and the property tests):
- the reference count of every physical block equals the number of block-table entries that point at it;
- ``free + used == total`` in each pool, and a block is never freed twice;
- ``len(table) == ceil(num_tokens / block_size)`` for every sequence (on-demand allocation);
- a method that raises leaves the manager unchanged.

This module is pure Python. The scheduler talks to it through the group-level methods at the bottom, which take
duck-typed sequence groups (``group.get_seqs(status)``, ``seq.seq_id``, ``seq.get_len()``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable

from pagedattn.config import blocks_needed, check_block_size
from pagedattn.memory.block_pool import BlockPool, NoFreeBlocksError


class AllocStatus(Enum):
    """Whether a request's blocks can be allocated now (OK), after others finish (LATER), or never (NEVER)."""

    OK = "ok"
    LATER = "later"
    NEVER = "never"


@dataclass
class BlockTable:
    """One sequence's logical-to-physical mapping, on the device ("gpu") or swapped out ("cpu")."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    device: str = "gpu"


class BlockManager:
    """The paged KV manager: one device pool, one CPU pool for swapping, a block table per sequence."""

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0, watermark: float = 0.01,
                 max_model_len: int | None = None) -> None:
        check_block_size(block_size)
        if num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be > 0, got {num_gpu_blocks}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.gpu = BlockPool(num_gpu_blocks, block_size, "gpu")
        self.cpu = BlockPool(num_cpu_blocks, block_size, "cpu")
        # Keep a few blocks free at admission so running sequences can grow without immediate preemption.
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.tables: dict[int, BlockTable] = {}

    # ----------------------------------------------------------------------------------------------- queries
    @property
    def num_gpu_blocks(self) -> int:
        return self.gpu.num_blocks

    @property
    def num_free_gpu_blocks(self) -> int:
        return self.gpu.num_free

    @property
    def num_used_gpu_blocks(self) -> int:
        return self.gpu.num_used

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables[seq_id].blocks

    def num_tokens(self, seq_id: int) -> int:
        return self.tables[seq_id].num_tokens

    def slot(self, seq_id: int, pos: int) -> int:
        """Flat slot index (``block * block_size + offset``) where token ``pos`` of the sequence lives."""
        return self.tables[seq_id].blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        blocks, bs = self.tables[seq_id].blocks, self.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def num_filled_slots(self) -> int:
        """Device slots holding a token's K/V, each physical slot counted once however many tables share it."""
        fill: dict[int, int] = {}
        bs = self.block_size
        for t in self.tables.values():
            if t.device != "gpu":
                continue
            for i, b in enumerate(t.blocks):
                fill[b] = max(fill.get(b, 0), min(bs, t.num_tokens - i * bs))
        return sum(fill.values())

    def num_logical_blocks(self) -> int:
        """Blocks the device-resident sequences would hold without sharing (paper Fig. 15's denominator)."""
        return sum(len(t.blocks) for t in self.tables.values() if t.device == "gpu")

    # -------------------------------------------------------------------------------- per-sequence operations
    def check_request(self, num_tokens: int) -> None:
        """Raise ValueError, naming the limit, for a request that could never be served."""
        if num_tokens < 1:
            raise ValueError(f"a request needs at least 1 token, got {num_tokens}")
        if self.max_model_len is not None and num_tokens > self.max_model_len:
            raise ValueError(f"request of {num_tokens} tokens exceeds the model maximum max_model_len="
                             f"{self.max_model_len}")
        need = blocks_needed(num_tokens, self.block_size)
        if need > self.gpu.num_blocks:
            raise ValueError(f"request of {num_tokens} tokens needs {need} blocks of {self.block_size} but the whole "
                             f"pool has only num_gpu_blocks={self.gpu.num_blocks}")

    def can_allocate_tokens(self, num_tokens: int) -> AllocStatus:
        try:
            self.check_request(num_tokens)
        except ValueError:
            return AllocStatus.NEVER
        need = blocks_needed(num_tokens, self.block_size)
        if self.gpu.num_blocks - need < self.watermark_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if self.gpu.num_free - need >= self.watermark_blocks else AllocStatus.LATER

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Give a new sequence the blocks for its first ``num_tokens`` tokens (the prompt, §4.3)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        self.check_request(num_tokens)
        need = blocks_needed(num_tokens, self.block_size)
        if need > self.gpu.num_free:
            raise NoFreeBlocksError(f"need {need} blocks, {self.gpu.num_free} free")
        self.tables[seq_id] = BlockTable([self.gpu.allocate() for _ in range(need)], num_tokens)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent; reference counts go up, nothing is copied (§4.4)."""
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        parent = self.tables[parent_id]
        pool = self._pool(parent.device)
        for b in parent.blocks:
            pool.incref(b)
        self.tables[child_id] = BlockTable(list(parent.blocks), parent.num_tokens, parent.device)

    def needs_new_block(self, seq_id: int) -> bool:
        """Whether appending one token to the sequence takes a block (its last is full, or shared: copy-on-write)."""
        t = self.tables[seq_id]
        return t.num_tokens % self.block_size == 0 or self.gpu.ref_counts[t.blocks[-1]] > 1

    def append_slot(self, seq_id: int) -> tuple[int, int] | None:
        """Make room for one more token. Returns the ``(src, dst)`` block copy when copy-on-write happened."""
        t = self.tables[seq_id]
        if t.device != "gpu":
            raise ValueError(f"sequence {seq_id} is swapped out; swap it in before appending")
        if self.max_model_len is not None and t.num_tokens + 1 > self.max_model_len:
            raise ValueError(f"sequence {seq_id} would exceed max_model_len={self.max_model_len}")
        if t.num_tokens % self.block_size == 0:  # last block full (or no block yet): a new block, on demand
            t.blocks.append(self.gpu.allocate())
            t.num_tokens += 1
            return None
        last = t.blocks[-1]
        copy = None
        if self.gpu.ref_counts[last] > 1:  # shared partially filled block: copy-on-write
            new = self.gpu.allocate()
            self.gpu.decref(last)
            t.blocks[-1] = new
            copy = (last, new)
        t.num_tokens += 1
        return copy

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (a block returns to its pool when its last reference goes)."""
        if seq_id not in self.tables:
            raise KeyError(f"sequence {seq_id} has no block table (already freed?)")
        t = self.tables.pop(seq_id)
        pool = self._pool(t.device)
        for b in t.blocks:
            pool.decref(b)

    def _pool(self, device: str) -> BlockPool:
        return self.gpu if device == "gpu" else self.cpu

    def _unique_blocks(self, seq_ids: Iterable[int], device: str) -> list[int]:
        seen: dict[int, None] = {}
        for s in seq_ids:
            t = self.tables[s]
            if t.device != device:
                raise ValueError(f"sequence {s} is on {t.device}, expected {device}")
            seen.update(dict.fromkeys(t.blocks))
        return list(seen)

    def swap_out(self, seq_ids: list[int]) -> dict[int, int]:
        """Move the sequences' blocks to the CPU pool; returns the ``{gpu_block: cpu_block}`` copies (§4.5).

        Blocks shared between the sequences are moved once and stay shared on the CPU."""
        blocks = self._unique_blocks(seq_ids, "gpu")
        if len(blocks) > self.cpu.num_free:
            raise ValueError(f"swap-out needs {len(blocks)} CPU blocks but only {self.cpu.num_free} of "
                             f"num_cpu_blocks={self.cpu.num_blocks} are free")
        return self._move(seq_ids, blocks, self.gpu, self.cpu, "cpu")

    def can_swap_in(self, seq_ids: list[int], reserve: int = 0) -> bool:
        need = len(self._unique_blocks(seq_ids, "cpu")) + reserve
        return self.gpu.num_free - need >= self.watermark_blocks

    def swap_in(self, seq_ids: list[int]) -> dict[int, int]:
        """Bring swapped sequences back to the device pool; returns the ``{cpu_block: gpu_block}`` copies."""
        blocks = self._unique_blocks(seq_ids, "cpu")
        if len(blocks) > self.gpu.num_free:
            raise ValueError(f"swap-in needs {len(blocks)} device blocks but only {self.gpu.num_free} of "
                             f"num_gpu_blocks={self.gpu.num_blocks} are free")
        return self._move(seq_ids, blocks, self.cpu, self.gpu, "gpu")

    def _move(self, seq_ids: list[int], blocks: list[int], src: BlockPool, dst: BlockPool, device: str
              ) -> dict[int, int]:
        mapping = {b: dst.allocate() for b in blocks}  # each destination block starts with one reference
        refs = Counter(b for s in seq_ids for b in self.tables[s].blocks)
        for s in seq_ids:
            t = self.tables[s]
            t.blocks = [mapping[b] for b in t.blocks]
            t.device = device
        for b, n in refs.items():  # every table entry moves one reference from its source to its destination
            for _ in range(n - 1):
                dst.incref(mapping[b])
            for _ in range(n):
                src.decref(b)
        return mapping

    # ------------------------------------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Assert the invariants of the module docstring (used by tests)."""
        for pool in (self.gpu, self.cpu):
            counts = [0] * pool.num_blocks
            for t in self.tables.values():
                if t.device == pool.device:
                    for b in t.blocks:
                        counts[b] += 1
            assert counts == pool.ref_counts, f"{pool.device} reference counts disagree with block tables"
            free = list(pool._free)
            assert len(free) == len(set(free)), f"{pool.device} free list holds a block twice"
            assert all(pool.ref_counts[b] == 0 for b in free), f"{pool.device} free list holds a used block"
            assert pool.num_free + sum(1 for c in pool.ref_counts if c > 0) == pool.num_blocks
        for s, t in self.tables.items():
            assert len(t.blocks) == blocks_needed(t.num_tokens, self.block_size), f"seq {s}: table size"

    # ------------------------------------------------------------------- group-level API (the scheduler's)
    def can_allocate(self, group) -> AllocStatus:
        """Whether a waiting group's prompt (all its tokens, when recomputing) fits now (§4.3, §4.5)."""
        seqs = group.get_seqs(status="waiting")
        return self.can_allocate_tokens(seqs[0].get_len())

    def allocate_group(self, group) -> None:
        """Allocate the prompt once and share it across the group's sequences (parallel sampling, §4.4)."""
        seqs = group.get_seqs(status="waiting")
        self.allocate(seqs[0].seq_id, seqs[0].get_len())
        for s in seqs[1:]:
            self.fork(seqs[0].seq_id, s.seq_id)

    def can_append_slots(self, group) -> bool:
        need = sum(self.needs_new_block(s.seq_id) for s in group.get_seqs(status="running"))
        return need <= self.gpu.num_free

    def append_slots(self, group) -> list[tuple[int, int]]:
        copies = []
        for s in group.get_seqs(status="running"):
            c = self.append_slot(s.seq_id)
            if c is not None:
                copies.append(c)
        return copies

    def free_seq(self, seq) -> None:
        if seq.seq_id in self.tables:
            self.free(seq.seq_id)

    def can_swap_out(self, group) -> bool:
        return len(self._unique_blocks([s.seq_id for s in group.get_seqs(status="running")], "gpu")) \
            <= self.cpu.num_free

    def swap_out_group(self, group) -> dict[int, int]:
        return self.swap_out([s.seq_id for s in group.get_seqs(status="running")])

    def can_swap_in_group(self, group) -> bool:
        seqs = [s.seq_id for s in group.get_seqs(status="swapped")]
        return self.can_swap_in(seqs, reserve=len(seqs))  # room for each sequence's next token

    def swap_in_group(self, group) -> dict[int, int]:
        return self.swap_in([s.seq_id for s in group.get_seqs(status="swapped")])
