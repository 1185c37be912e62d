"""Block tables over a pool of physical KV blocks (paper §4.2-§4.5).

Each sequence owns a *block table*: its logical blocks, in order, mapped to physical block ids. Blocks are allocated
on demand (a new one only when the last one is full), so a sequence wastes less than one block. ``_fork`` lets a
child share all of its parent's blocks (reference counts go up, nothing is copied); an append to a shared block
triggers *copy-on-write*: the writer gets a fresh block and the manager returns the ``(src, dst)`` copy for the
executor to perform (§4.4). Preemption moves a sequence group's blocks to a CPU pool and back (``_swap_out`` /
``_swap_in``) or frees them for recomputation (§4.5). A group moves as a unit and each of its blocks once; a prefix
block shared with other groups is identified in both pools by its prefix digest, so it is copied to the CPU once
however many groups are swapped out, stays shared there, and shares the device's copy again on the way back.

Invariants (checked by ``check_invariants`` and the property tests):
- the reference count of every physical block equals the number of block-table entries that point at it;
- ``free + used == total`` in each pool, and a block is never freed twice;
- ``len(table) == ceil(num_tokens / block_size)`` for every sequence (on-demand allocation);
- a method that raises leaves the manager unchanged.

Prefix caching (beyond the paper, as in vLLM's automatic prefix caching; the paper's §4.4 shares a prefix only when
the user marks it): every *full* block is identified by a hash of its tokens chained with the hash of everything
before it, so equal prefixes give equal hashes. A new request reuses the cached blocks of its longest cached prefix
(reference counts go up) and computes only the rest. Freed cached blocks keep their K/V on the pool's evictable list
until a new block is needed (least recently used first; never one that is referenced). Only full blocks are ever
cached, and a full block is never written again, so a shared block is never written without copy-on-write; the last
prompt token is always computed, in a block of its own, so a fully cached prompt still yields its logits.
With ``enable_prefix_caching=False`` a request may still mark its first ``prefix_len`` tokens as a shared prefix
(the paper's mode, Fig. 16): those full blocks are cached and pinned (the manager holds one reference) so that every
request with the same marked prefix maps to them.

This module is pure Python. Its public API is the ``memory.interface`` protocols alone (``KVManager``, and
``KVDecodeRuns`` for the simulator), plus a few read-only counters: the group-level methods at the bottom take
duck-typed sequence groups (``group.get_seqs(status)``, ``seq.seq_id``, ``seq.get_len()``) and the inspector reads
state. They are built from the per-sequence steps in the middle (``_allocate``, ``_fork``, ``_append_slot``,
``_free``, ``_swap_out``, ``_swap_in`` and their checks), which are private: the tests and the tour's worked
examples call them one sequence at a time through ``memory.per_sequence.PerSequence``.
"""
from __future__ import annotations

import hashlib
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from pagedattn.config import blocks_needed, check_block_size
from pagedattn.memory.accounting import KVStats
from pagedattn.memory.block_pool import BlockPool, NoFreeBlocksError
from pagedattn.memory.interface import AllocStatus, BlockCopies, BlockView, PoolCounts, SeqView

__all__ = ["AllocStatus", "BlockManager", "BlockTable", "block_hashes"]


@dataclass
class BlockTable:
    """One sequence's logical-to-physical mapping, on the device ("gpu") or swapped out ("cpu")."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    device: str = "gpu"
    hashes: list[bytes] = field(default_factory=list)  # prefix digests of the full blocks (prefix caching only)


def block_hashes(token_ids, block_size: int, num_blocks: int, parent: bytes | None = None) -> list[bytes]:
    """Chained digests of the first ``num_blocks`` full blocks: ``h_i = BLAKE2b(h_{i-1} || tokens of block i)``.

    A 256-bit cryptographic digest, not Python's ``hash``: equal digests mean equal token prefixes (up to BLAKE2b's
    collision resistance), so no prompt can be crafted to read another request's K/V. Token ids are encoded as
    fixed-width little-endian 64-bit integers; the first block has no parent, and its message is shorter than every
    later one's. Cost: ``benchmarks/prefix_hash.py`` (a few microseconds per block on a CPU)."""
    n = num_blocks * block_size
    if len(token_ids) < n:
        raise ValueError(f"{num_blocks} full blocks of {block_size} need {n} token ids, got {len(token_ids)}")
    data, step, out = struct.pack(f"<{n}q", *token_ids[:n]), 8 * block_size, []
    for i in range(0, num_blocks * step, step):
        parent = hashlib.blake2b((parent or b"") + data[i:i + step], digest_size=32).digest()
        out.append(parent)
    return out


class BlockManager:
    """The paged KV manager: one device pool, one CPU pool for swapping, a block table per sequence."""

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0, watermark: float = 0.01,
                 max_model_len: int | None = None, enable_prefix_caching: bool = False) -> None:
        check_block_size(block_size)
        if num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be > 0, got {num_gpu_blocks}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be a fraction of the pool in [0, 1), got {watermark}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.gpu = BlockPool(num_gpu_blocks, block_size, "gpu")
        self.cpu = BlockPool(num_cpu_blocks, block_size, "cpu")
        # Keep a few blocks free at admission so running sequences can grow without immediate preemption.
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.tables: dict[int, BlockTable] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.pinned: list[int] = []  # blocks of user-marked shared prefixes, held by the manager
        self.prefix_queries = 0  # full prompt blocks looked up in the prefix cache
        self.prefix_hits = 0  # ... and found there

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

    def block_table(self, seq_id: int, num_tokens: int | None = None) -> list[int]:
        blocks = self.tables[seq_id].blocks
        need = len(blocks) if num_tokens is None else -(-num_tokens // self.block_size)
        return blocks if len(blocks) <= need else blocks[:need]  # usually all of them: no copy

    def num_tokens(self, seq_id: int) -> int:
        return self.tables[seq_id].num_tokens

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat slots of the sequence's tokens ``start .. end - 1``: where the executor writes their K/V (§4.1)."""
        blocks, bs = self.tables[seq_id].blocks, self.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def location(self, seq_id: int) -> tuple[str, int] | None:
        t = self.tables.get(seq_id)
        return None if t is None else (t.device, t.num_tokens)

    def seq_ids(self) -> list[int]:
        """The sequences holding blocks, on the device or swapped out, sorted."""
        return sorted(self.tables)

    def prefix_digests(self, seq_id: int) -> list[bytes]:
        """The prefix digests of the sequence's full blocks (prefix caching; empty without it)."""
        return list(self.tables[seq_id].hashes)

    def cache_layout(self) -> tuple[int, int, int]:
        return self.gpu.num_blocks, self.block_size, self.cpu.num_blocks

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

    @property
    def prefix_hit_rate(self) -> float:
        """Share of looked-up full prompt blocks that were found in the prefix cache."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def stats(self, final_len: dict[int, int] | None = None) -> KVStats:
        """A snapshot of the device memory (``memory.accounting.KVStats``); ``final_len[seq_id]``: each sequence's
        KV length at its end, where known (what tells reserved slots from internal fragmentation)."""
        return paged_stats(self, final_len or {})

    def pool_counts(self) -> PoolCounts:
        """The device and CPU pools' blocks in all and free, and the prefix cache's lookups and hits."""
        return PoolCounts(self.gpu.num_blocks, self.gpu.num_free, self.cpu.num_blocks, self.cpu.num_free,
                          self.prefix_queries, self.prefix_hits, self.gpu.num_evictions)

    def block_view(self, pool: str = "gpu") -> BlockView:
        """A copy of ``pool``'s blocks (``interface.BlockView``; the device's unless asked): the tables in that pool
        by seq id, reference counts, pinned prefix blocks (device only), cached blocks and their digests, and the
        free blocks in the order they are handed out."""
        if pool not in ("gpu", "cpu"):
            raise ValueError(f"pool must be 'gpu' or 'cpu', got {pool!r}")
        p = self._pool(pool)
        tables = {s: (list(t.blocks), t.num_tokens) for s, t in sorted(self.tables.items()) if t.device == pool}
        pinned = list(self.pinned) if pool == "gpu" else []
        return BlockView(tables, list(p.ref_counts), pinned, sorted(p.block_hash), dict(p.block_hash), p.free_order())

    def num_logical_blocks(self) -> int:
        """Blocks the device-resident sequences would hold without sharing (paper Fig. 15's denominator)."""
        return sum(len(t.blocks) for t in self.tables.values() if t.device == "gpu")

    # ------------------------------------------------- per-sequence steps (private; ``per_sequence.PerSequence``)
    def _check_request(self, num_tokens: int, token_ids=None, prefix_len: int = 0) -> None:
        """Raise ValueError, naming the limit, for a request that could never be served. Given its ``token_ids``,
        the user-marked prefixes that it does not share count as taken: the manager holds them for good."""
        self._check_limits(num_tokens, None if token_ids is None else self._hits(num_tokens, token_ids, prefix_len))

    def _check_limits(self, num_tokens: int, hits: list[int] | None) -> None:
        """``_check_request`` given the prompt's cache ``hits`` (None: its tokens are unknown)."""
        if num_tokens < 1:
            raise ValueError(f"a request needs at least 1 token, got {num_tokens}")
        if self.max_model_len is not None and num_tokens > self.max_model_len:
            raise ValueError(f"request of {num_tokens} tokens exceeds the model maximum max_model_len="
                             f"{self.max_model_len}")
        need = blocks_needed(num_tokens, self.block_size)
        if need > self.gpu.num_blocks:
            raise ValueError(f"request of {num_tokens} tokens needs {need} blocks of {self.block_size} but the whole "
                             f"pool has only num_gpu_blocks={self.gpu.num_blocks}")
        pinned = 0 if hits is None else self._pinned_elsewhere(hits)
        if need + pinned > self.gpu.num_blocks:
            raise ValueError(f"request of {num_tokens} tokens needs {need} blocks of {self.block_size}, but "
                             f"{pinned} of the pool's num_gpu_blocks={self.gpu.num_blocks} hold user-marked prefixes "
                             "it does not share")

    def _hits(self, num_tokens: int, token_ids, prefix_len: int) -> list[int]:
        """Cached blocks of the prompt's longest cached prefix (none without token ids)."""
        cacheable = self._cacheable(num_tokens, prefix_len) if token_ids is not None else 0
        if cacheable < self.block_size:
            return []
        return self._match(block_hashes(token_ids, self.block_size, cacheable // self.block_size), num_tokens)

    def _pinned_elsewhere(self, hits: Iterable[int | None]) -> int:
        """User-marked prefix blocks (held for good) that a request with these cache hits does not share."""
        return len(set(self.pinned) - set(hits)) if self.pinned else 0

    def _cacheable(self, num_tokens: int, prefix_len: int) -> int:
        """Tokens whose full blocks may be cached: all (automatic caching) or the user-marked prefix."""
        return num_tokens if self.enable_prefix_caching else min(prefix_len, num_tokens)

    def _match(self, hashes: list[bytes], num_tokens: int) -> list[int]:
        """Cached blocks of the longest cached prefix, leaving at least the last token to compute."""
        hits = []
        for h in hashes[: (num_tokens - 1) // self.block_size]:
            b = self.gpu.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _can_allocate_tokens(self, num_tokens: int, token_ids=None, prefix_len: int = 0) -> AllocStatus:
        hits = self._hits(num_tokens, token_ids, prefix_len)  # the prompt's digests, computed once per check
        try:
            self._check_limits(num_tokens, None if token_ids is None else hits)
        except ValueError:
            return AllocStatus.NEVER
        need = blocks_needed(num_tokens, self.block_size)
        if self.gpu.num_blocks - self._pinned_elsewhere(hits) - need < self.watermark_blocks:
            return AllocStatus.NEVER
        if hits:  # blocks already held by others cost nothing new
            need -= sum(self.gpu.ref_counts[b] > 0 for b in hits)
        return AllocStatus.OK if self.gpu.num_free - need >= self.watermark_blocks else AllocStatus.LATER

    def _allocate(self, seq_id: int, num_tokens: int, token_ids=None, prefix_len: int = 0) -> int:
        """Give a new sequence the blocks for its first ``num_tokens`` tokens (the prompt, §4.3).

        With ``token_ids`` and prefix caching (automatic, or a user-marked ``prefix_len``), cached blocks of the
        prompt's prefix are reused. Returns the number of tokens whose K/V are already cached."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        self._check_request(num_tokens)
        bs = self.block_size
        cacheable = self._cacheable(num_tokens, prefix_len) if token_ids is not None else 0
        hashes = block_hashes(token_ids, bs, cacheable // bs) if cacheable >= bs else []
        hits = self._match(hashes, num_tokens)
        need = blocks_needed(num_tokens, bs) - sum(self.gpu.ref_counts[b] > 0 for b in hits)
        if need > self.gpu.num_free:
            raise NoFreeBlocksError(f"need {need} blocks, {self.gpu.num_free} free")
        for b in hits:
            self.gpu.touch(b)
        blocks = hits + [self.gpu.allocate() for _ in range(blocks_needed(num_tokens, bs) - len(hits))]
        for i in range(len(hits), len(hashes)):  # the new full blocks this prefill computes become cached
            self.gpu.register(blocks[i], hashes[i])
            if not self.enable_prefix_caching and self.gpu.block_hash.get(blocks[i]) == hashes[i]:
                self.gpu.incref(blocks[i])  # pin a user-marked prefix block
                self.pinned.append(blocks[i])
        self.prefix_queries += len(hashes)
        self.prefix_hits += len(hits)
        self.tables[seq_id] = BlockTable(blocks, num_tokens, hashes=hashes if self.enable_prefix_caching else [])
        return len(hits) * bs

    def _fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent; reference counts go up, nothing is copied (§4.4)."""
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        parent = self.tables[parent_id]
        pool = self._pool(parent.device)
        for b in parent.blocks:
            pool.incref(b)
        self.tables[child_id] = BlockTable(list(parent.blocks), parent.num_tokens, parent.device,
                                           list(parent.hashes))

    def _append_slot(self, seq_id: int, token_ids=None) -> tuple[int, int] | None:
        """Make room for one more token. Returns the ``(src, dst)`` block copy when copy-on-write happened.

        With automatic prefix caching, pass the sequence's ``token_ids`` (including the token being appended):
        a block that this token fills becomes cached."""
        t = self.tables[seq_id]
        if t.device != "gpu":
            raise ValueError(f"sequence {seq_id} is swapped out; swap it in before appending")
        if self.max_model_len is not None and t.num_tokens + 1 > self.max_model_len:
            raise ValueError(f"sequence {seq_id} would exceed max_model_len={self.max_model_len}")
        copy = None
        if t.num_tokens % self.block_size == 0:  # last block full (or no block yet): a new block, on demand
            t.blocks.append(self.gpu.allocate())
        elif self.gpu.ref_counts[t.blocks[-1]] > 1:  # shared partially filled block: copy-on-write
            last = t.blocks[-1]
            new = self.gpu.allocate()
            self.gpu.decref(last)
            t.blocks[-1] = new
            copy = (last, new)
        t.num_tokens += 1
        if self.enable_prefix_caching and token_ids is not None and t.num_tokens % self.block_size == 0 \
                and len(t.hashes) == t.num_tokens // self.block_size - 1:
            i = len(t.hashes)
            t.hashes += block_hashes(token_ids[i * self.block_size:], self.block_size, 1,
                                     t.hashes[-1] if t.hashes else None)
            self.gpu.register(t.blocks[i], t.hashes[i])
        return copy

    def _free(self, seq_id: int) -> None:
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

    @staticmethod
    def _held(pool: BlockPool, h: bytes | None) -> int | None:
        """The block of ``pool`` in use (referenced) that holds the K/V of prefix digest ``h``, if any."""
        b = pool.lookup(h)
        return b if b is not None and pool.ref_counts[b] > 0 else None

    def _num_new_blocks(self, blocks: list[int], src: BlockPool, dst: BlockPool) -> int:
        """Free blocks of ``dst`` that moving ``blocks`` there takes: one each, except a block whose K/V ``dst``
        already holds for another table (same prefix digest), which is shared instead of copied."""
        return sum(self._held(dst, src.block_hash.get(b)) is None for b in blocks)

    def _swap_out(self, seq_ids: list[int]) -> dict[int, int]:
        """Move the sequences' blocks to the CPU pool; returns the ``{gpu_block: cpu_block}`` copies (§4.5).

        Blocks shared between the sequences are moved once and stay shared on the CPU. A cached prefix block
        (automatic or user-marked) whose K/V the CPU pool already holds, because a group sharing it was swapped out
        before (in this step or earlier), is not copied again: the tables share the CPU copy."""
        blocks = self._unique_blocks(seq_ids, "gpu")
        need = self._num_new_blocks(blocks, self.gpu, self.cpu)
        if need > self.cpu.num_free:
            raise ValueError(f"swap-out needs {need} CPU blocks but only {self.cpu.num_free} of "
                             f"num_cpu_blocks={self.cpu.num_blocks} are free")
        return self._move(seq_ids, blocks, self.gpu, self.cpu, "cpu")

    def _swap_in(self, seq_ids: list[int]) -> dict[int, int]:
        """Bring swapped sequences back to the device pool; returns the ``{cpu_block: gpu_block}`` copies.

        A prefix block that the device still holds (a pinned prefix, or a cached block another group uses) is
        shared again instead of copied, so swapped groups regain their sharing."""
        blocks = self._unique_blocks(seq_ids, "cpu")
        need = self._num_new_blocks(blocks, self.cpu, self.gpu)
        if need > self.gpu.num_free:
            raise ValueError(f"swap-in needs {need} device blocks but only {self.gpu.num_free} of "
                             f"num_gpu_blocks={self.gpu.num_blocks} are free")
        return self._move(seq_ids, blocks, self.cpu, self.gpu, "gpu")

    def _move(self, seq_ids: list[int], blocks: list[int], src: BlockPool, dst: BlockPool, device: str
              ) -> dict[int, int]:
        """Re-point the tables from ``src`` to ``dst`` blocks; returns the block copies to perform, each source
        block at most once. A block that ``dst`` caches under the same prefix digest is reused (no copy); a copied
        block is registered under its digest in ``dst``, so that a later move of the same prefix shares it."""
        digest = {b: src.block_hash.get(b) for b in blocks}
        found = {b: d for b in blocks if (d := dst.lookup(digest[b])) is not None}
        for d in found.values():  # revive reused blocks first, so that allocating cannot evict them
            dst.touch(d)
        copies = {b: dst.allocate() for b in blocks if b not in found}  # each destination starts with one reference
        for b, d in copies.items():
            if (h := digest[b]) is not None:
                dst.register(d, h)
        mapping = found | copies
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
        return copies

    def _next_token_blocks(self, seq_ids: list[int]) -> int:
        """Blocks that one more token of each sequence takes (§4.3, §4.4): one for a full last block; for a partly
        filled last block shared by ``k`` of them, ``k - 1`` (copy-on-write; the last writer keeps the block)."""
        bs, tables = self.block_size, [self.tables[s] for s in seq_ids]
        partial = [t.blocks[-1] for t in tables if t.num_tokens % bs]  # k tables sharing one block: k - 1 copies
        return sum(t.num_tokens % bs == 0 for t in tables) + len(partial) - len(set(partial))

    # ------------------------------------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Assert the invariants of the module docstring (used by tests)."""
        for pool in (self.gpu, self.cpu):
            counts = [0] * pool.num_blocks
            for t in self.tables.values():
                if t.device == pool.device:
                    for b in t.blocks:
                        counts[b] += 1
            if pool is self.gpu:
                for b in self.pinned:
                    counts[b] += 1
            assert counts == pool.ref_counts, f"{pool.device} reference counts disagree with block tables"
            pool.check()
        for s, t in self.tables.items():
            assert len(t.blocks) == blocks_needed(t.num_tokens, self.block_size), f"seq {s}: table size"

    # ------------------------------------------------------------------- group-level API (the scheduler's)
    def can_allocate(self, group) -> AllocStatus:
        """Whether a waiting group's prompt (all its tokens, when recomputing) fits now (§4.3, §4.5)."""
        s = group.get_seqs("waiting")[0]
        return self._can_allocate_tokens(s.get_len(), s.token_ids, group.prefix_len)

    def never_reason(self, group) -> str:
        """Why a waiting group (its prompt) or a swapped group (its blocks) can never be served."""
        try:
            if group.get_seqs("swapped"):
                self._check_swap_in(group)
            else:
                s = group.get_seqs("waiting")[0]
                self._check_request(s.get_len(), s.token_ids, group.prefix_len)
        except ValueError as e:
            return str(e)
        return "request can never fit in the KV cache (watermark)"

    def check_group_blocks(self, num_blocks: int, what: str) -> None:
        room = self.gpu.num_blocks - self.watermark_blocks
        if num_blocks > room:
            raise ValueError(f"{what} may need {num_blocks} blocks of {self.block_size}, but the pool has only "
                             f"num_gpu_blocks={self.gpu.num_blocks} ({self.watermark_blocks} kept free)")

    def allocate_group(self, group) -> int:
        """Allocate the prompt once and share it across the group's sequences (parallel sampling, §4.4); returns
        the number of prompt tokens already cached."""
        seqs = group.get_seqs("waiting")
        cached = self._allocate(seqs[0].seq_id, seqs[0].get_len(), seqs[0].token_ids, group.prefix_len)
        for s in seqs[1:]:
            self._fork(seqs[0].seq_id, s.seq_id)
        return cached

    def fork_into(self, parent_id: int, child_id: int) -> BlockCopies:
        """The child drops its blocks and shares the parent's: nothing is copied (beam search, §4.4, Fig. 9). The
        blocks that both tables already hold at the same place (beams share most of their history) keep their
        reference counts: only the child's others are let go and the parent's others shared, which leaves the pools
        as ``_free(child_id)`` then ``_fork(parent_id, child_id)`` would."""
        if parent_id == child_id:
            raise ValueError(f"sequence {child_id} cannot be forked into itself")
        parent, child = self.tables[parent_id], self.tables.get(child_id)
        if child is None or child.device != parent.device:
            self._free(child_id)
            self._fork(parent_id, child_id)
            return []
        pb, cb = parent.blocks, child.blocks
        common = min(len(pb), len(cb))
        # the shared history ends where the tables first differ: a block held at the same place by both came from
        # one fork, and so did every block before it (forks share prefixes; copy-on-write replaces only last blocks)
        while common and pb[common - 1] != cb[common - 1]:
            common -= 1
        pool = self._pool(parent.device)
        for b in cb[common:]:
            pool.decref(b)
        for b in pb[common:]:
            pool.incref(b)
        self.tables[child_id] = BlockTable(list(pb), parent.num_tokens, parent.device, list(parent.hashes))
        return []

    def can_append_slots(self, group) -> bool:
        need, bs, refs = 0, self.block_size, self.gpu.ref_counts
        for s in group.get_seqs("running"):  # one more token takes a block when the last is full or shared
            t = self.tables[s.seq_id]
            if t.num_tokens % bs == 0 or refs[t.blocks[-1]] > 1:
                need += 1
        return need == 0 or need <= self.gpu.num_free

    def append_slots(self, group) -> BlockCopies:
        copies = []
        for s in group.get_seqs("running"):
            c = self._append_slot(s.seq_id, s.token_ids)
            if c is not None:
                copies.append((c[0], c[1], 1))
        return copies

    def decode_room(self, seqs: list[SeqView], limit: int) -> int:
        """Decode steps in a row (at most ``limit``) that these sequences take with no preemption or copy: until
        the new blocks that their appends need, step by step, would outnumber the free blocks (each sequence needs
        one whenever its last block is full, §4.3). 0 where a step could copy (a shared last block) or register a
        cached block (prefix caching)."""
        if limit <= 0 or self.enable_prefix_caching:
            return 0
        bs, refs, max_len = self.block_size, self.gpu.ref_counts, self.max_model_len
        new_blocks = [0] * (limit + 1)  # by step (1-based)
        for s in seqs:
            t = self.tables[s.seq_id]
            n = t.num_tokens
            if t.device != "gpu" or n % bs and refs[t.blocks[-1]] > 1:
                return 0
            if max_len is not None and n + limit > max_len:
                limit = max(max_len - n, 0)
            for step in range(-n % bs + 1, limit + 1, bs):
                new_blocks[step] += 1
        free = self.gpu.num_free
        for step in range(1, limit + 1):
            free -= new_blocks[step]
            if free < 0:
                return step - 1
        return limit

    def advance(self, seqs: list[SeqView], steps: int) -> None:
        """``steps`` decode steps of these sequences at once (``decode_room``): their new blocks are taken from the
        pool in the order that step-by-step appends take them (by step, then in ``seqs`` order)."""
        bs, allocate = self.block_size, self.gpu.allocate
        needs: list[tuple[int, BlockTable]] = []  # (step, table) of each new block, in ``seqs`` order
        for s in seqs:
            t = self.tables[s.seq_id]
            first = -t.num_tokens % bs + 1  # the step whose token opens a block (1 when the last block is full)
            t.num_tokens += steps
            while first <= steps:
                needs.append((first, t))
                first += bs
        if steps > 1:  # by step, then in order (a stable sort); one step's are in order already
            needs.sort(key=lambda need: need[0])
        for _, t in needs:
            t.blocks.append(allocate())

    def free_seq(self, seq) -> None:
        if seq.seq_id in self.tables:
            self._free(seq.seq_id)

    def can_swap_out(self, group) -> bool:
        blocks = self._unique_blocks([s.seq_id for s in group.get_seqs("running")], "gpu")
        return self._num_new_blocks(blocks, self.gpu, self.cpu) <= self.cpu.num_free

    def swap_out_group(self, group) -> dict[int, int]:
        return self._swap_out([s.seq_id for s in group.get_seqs("running")])

    def swap_in_status(self, group) -> AllocStatus:
        """Whether a swapped-out group can come back now (OK), after others finish (LATER), or never (NEVER) (§4.5).

        It takes its distinct blocks that the device does not already hold (a pinned or cached prefix in use is
        shared again), plus the blocks its next tokens need (``_next_token_blocks``: none for a sequence whose last
        block has room), and leaves the watermark free."""
        seqs = [s.seq_id for s in group.get_seqs("swapped")]
        blocks, grow = self._unique_blocks(seqs, "cpu"), self._next_token_blocks(seqs)
        try:
            self._check_swap_in_room(group, blocks, grow)
        except ValueError:
            return AllocStatus.NEVER
        need = self._num_new_blocks(blocks, self.cpu, self.gpu) + grow
        return AllocStatus.OK if self.gpu.num_free - need >= self.watermark_blocks else AllocStatus.LATER

    def can_swap_in_group(self, group) -> bool:
        return self.swap_in_status(group) is AllocStatus.OK

    def _check_swap_in(self, group) -> None:
        """Raise ValueError, naming the limit, for a swapped-out group that could not come back even when every
        other request is gone: its distinct blocks plus its next tokens' blocks exceed the pool, less the
        watermark and the pinned prefixes it does not share."""
        seqs = [s.seq_id for s in group.get_seqs("swapped")]
        self._check_swap_in_room(group, self._unique_blocks(seqs, "cpu"), self._next_token_blocks(seqs))

    def _check_swap_in_room(self, group, blocks: list[int], grow: int) -> None:
        """``_check_swap_in`` given the group's distinct CPU ``blocks`` and its next tokens' ``grow``."""
        others = self._pinned_elsewhere([self.gpu.lookup(self.cpu.block_hash.get(b)) for b in blocks])
        if len(blocks) + grow > self.gpu.num_blocks - self.watermark_blocks - others:
            raise ValueError(
                f"request {group.request_id!r} grew to {len(blocks)} distinct blocks (its next tokens need {grow} "
                f"more) and cannot be swapped back into the pool of num_gpu_blocks={self.gpu.num_blocks} blocks "
                f"({self.watermark_blocks} kept free by the watermark, {others} held by other pinned prefixes)")

    def swap_in_group(self, group) -> dict[int, int]:
        return self._swap_in([s.seq_id for s in group.get_seqs("swapped")])


# ------------------------------------------------------------------------------ Fig. 2's accounting (§3)
def paged_stats(m: BlockManager, final_len: dict[int, int]) -> KVStats:
    """``KVStats`` of a ``BlockManager``, in one pass over its device tables when no block is shared (a running
    replay's usual state; the simulator asks this every step), else counting each shared block once."""
    bs = m.block_size
    states = ends = nblocks = waste = 0
    for seq_id, t in m.tables.items():
        if t.device != "gpu":
            continue
        n, size = t.num_tokens, len(t.blocks) * bs
        nblocks += len(t.blocks)
        states += n
        end = final_len.get(seq_id, n)
        end = n if end < n else end  # a sequence past its final length (never in a replay) fills what it holds
        ends += size if size < end else end
        if size - n > waste:
            waste = size - n
    used = m.gpu.num_used
    allocated = used * bs
    if nblocks != used:  # shared blocks (or pinned prefixes): each physical block counted once
        states, reserved = _shared_blocks(m, final_len)
        ends = states + reserved
    hit = m.prefix_hits / m.prefix_queries if m.prefix_queries else None
    return KVStats(states, ends - states, allocated - ends, m.gpu.num_blocks * bs - allocated, waste,
                   used - len(m.pinned), nblocks, hit)


def _shared_blocks(m: BlockManager, final_len: dict[int, int]) -> tuple[int, int]:
    """Token-state and reserved slots when blocks are shared: a block's slots are filled (or will be) as far as its
    furthest sharer fills them. A block full of one sharer's tokens is full for all (every slot filled and to be
    filled), so only the entries past each table's full blocks (usually its last) are looked at, and the full
    blocks are counted without walking the tables: a block's reference count is the number of device-table entries
    that point at it plus its pins (``BlockManager.check_invariants``), so a block sits among some table's full
    blocks exactly when it has more entries than those past the full ones, and the tables' distinct blocks are the
    pool's used blocks less those that only pins hold."""
    bs, refs, pins = m.block_size, m.gpu.ref_counts, Counter(m.pinned)
    alone = filled = future = 0  # blocks past the full ones with one reference (this entry's), and their slots
    shared: dict[int, list[int]] = {}  # other such blocks -> [entries past full blocks, slots filled, to be filled]
    for seq_id, t in m.tables.items():
        if t.device != "gpu":
            continue
        blocks, n = t.blocks, t.num_tokens
        end = max(final_len.get(seq_id, n), n)
        for i in range(min(len(blocks), n // bs), len(blocks)):
            b, lo = blocks[i], i * bs
            f = n - lo if n > lo else 0  # under a block: it is past the full ones
            u = bs if end - lo > bs else end - lo if end > lo else 0
            if refs[b] == 1:
                alone, filled, future = alone + 1, filled + f, future + u
            elif (p := shared.get(b)) is None:
                shared[b] = [1, f, u]
            else:
                p[0], p[1], p[2] = p[0] + 1, max(p[1], f), max(p[2], u)
    partial = [p for b, p in shared.items() if refs[b] - pins[b] == p[0]]  # among no table's full blocks
    full = m.gpu.num_used - sum(refs[b] == k for b, k in pins.items()) - alone - len(partial)
    states = bs * full + filled + sum(p[1] for p in partial)
    return states, future - filled + sum(p[2] - p[1] for p in partial)
