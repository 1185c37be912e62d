"""Orca-style contiguous KV reservation over a real buddy allocator (the paper's baselines, §2.3 and §6.1).

Each request reserves one contiguous chunk of token slots when it is admitted. As the paper defines them (§6.1):
- Orca (Max) reserves the model's maximum sequence length (2048);
- Orca (Pow2) reserves the prompt plus the output length rounded up to a power of two ("over-reserves the space
  for outputs by at most 2x": a 25-token output reserves 32 positions);
- Orca (Oracle) reserves exactly the true length (prompt + output).

All three are carved out of one fixed KV arena by a binary buddy allocator (the paper's Orca uses buddy
allocation), so external fragmentation comes from the allocator, not from a formula. A strict buddy allocator
places a reservation in the smallest power-of-two block that holds it; the unused end of that block belongs to no
request and counts as external fragmentation ("external fragmentation and other" in Fig. 2). Oracle and Pow2 still
place differently because Pow2 rounds the *output*, so its reservation, and often its block, is larger.

``placement="exact"`` is a variant for comparison: it trims the block like Linux's ``alloc_pages_exact`` (keep the
pieces that cover the reservation, give the tail back), so the slack can serve other requests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagedattn.memory.interface import AllocStatus, BlockCopies, BlockMoves, PoolCounts, SeqView
from pagedattn.memory.accounting import KVStats

Policy = Literal["max", "pow2", "oracle"]


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class BuddyAllocator:
    """A binary buddy allocator over ``total`` slots (any size: the arena is split into power-of-two chunks).

    Blocks are ``(offset, order)`` with ``size = 2**order``; a block's buddy is ``offset ^ size``. Chunks are laid
    largest first, so every chunk starts at a multiple of its own size and buddies never cross a chunk."""

    def __init__(self, total: int) -> None:
        if total <= 0:
            raise ValueError(f"arena size must be > 0, got {total}")
        self.total = total
        self.free_lists: dict[int, set[int]] = {}
        self.allocated: dict[int, int] = {}  # offset -> order
        self.used = 0  # slots in allocated blocks (kept as they change: the engine core reads it every step)
        self._chunk_order: dict[int, int] = {}  # chunk start -> its order (the largest a block there may grow)
        off, rest = 0, total
        while rest:
            order = rest.bit_length() - 1
            self._chunk_order[off] = order
            self.free_lists.setdefault(order, set()).add(off)
            off, rest = off + (1 << order), rest - (1 << order)

    @property
    def max_block(self) -> int:
        """The largest block this arena can ever hand out (its first chunk)."""
        return 1 << self._chunk_order[0]

    @property
    def num_free(self) -> int:
        return self.total - self.used

    def largest_free(self) -> int:
        return max((1 << o for o, s in self.free_lists.items() if s), default=0)

    def _max_order_at(self, offset: int) -> int:
        start = max(c for c in self._chunk_order if c <= offset)
        return self._chunk_order[start]

    def can_alloc(self, size: int) -> bool:
        order = max(0, (size - 1).bit_length())  # next_pow2(size) is 2**order
        for o, s in self.free_lists.items():  # asked every step a request waits: a loop, not a generator
            if s and o >= order:
                return True
        return False

    def alloc(self, size: int) -> int:
        """Allocate a block of ``next_pow2(size)`` slots (lowest address first); return its offset."""
        order = next_pow2(size).bit_length() - 1
        candidates = [o for o, s in self.free_lists.items() if o >= order and s]
        if not candidates:
            raise MemoryError(f"no free buddy block of {1 << order} slots (free {self.num_free} of {self.total})")
        o = min(candidates)
        off = min(self.free_lists[o])
        self.free_lists[o].remove(off)
        while o > order:  # split, keeping the lower half and freeing the upper buddy
            o -= 1
            self.free_lists.setdefault(o, set()).add(off + (1 << o))
        self.allocated[off] = order
        self.used += 1 << order
        return off

    def free(self, offset: int) -> None:
        """Free a block and coalesce it with its free buddy, repeatedly."""
        if offset not in self.allocated:
            raise RuntimeError(f"double free (or unknown block) at offset {offset}")
        o = self.allocated.pop(offset)
        self.used -= 1 << o
        limit = self._max_order_at(offset)
        while o < limit:
            buddy = offset ^ (1 << o)
            if buddy not in self.free_lists.get(o, ()):
                break
            self.free_lists[o].remove(buddy)
            offset, o = min(offset, buddy), o + 1
        self.free_lists.setdefault(o, set()).add(offset)

    def alloc_exact(self, size: int) -> list[int]:
        """Allocate exactly ``size`` contiguous slots (``alloc_pages_exact``): the enclosing power-of-two block
        is split and its unused tail freed. Returns the offsets of the kept pieces, in address order."""
        off = self.alloc(size)
        order = self.allocated.pop(off)
        pieces: list[int] = []
        need = size
        while need:
            half = 1 << (order - 1) if order else 0
            if need == 1 << order:
                self.allocated[off] = order
                pieces.append(off)
                break
            if need <= half:  # keep the lower half, recurse; the upper half goes back to the allocator
                self.allocated[off + half] = order - 1
                self.free(off + half)
            else:  # keep the whole lower half, continue in the upper half
                self.allocated[off] = order - 1
                pieces.append(off)
                off, need = off + half, need - half
            order -= 1
        return pieces


@dataclass
class Reservation:
    pieces: list[int]
    reserved: int  # slots reserved (contiguous, starting at pieces[0])
    held: int  # slots it takes from the arena: its buddy block (next_pow2(reserved)), or exactly ``reserved``
    num_tokens: int = 0


class ContiguousKVManager:
    """Orca's memory manager: a contiguous reservation per sequence, decided at admission (§2.3).

    It implements the same ``memory.interface.KVManager`` protocol as ``BlockManager``; its "block table" is the
    list of the reservation's slots (block size 1). Reservations never grow, so Orca never preempts: it has no CPU
    pool, and the swap methods refuse."""

    block_size = 1

    def __init__(self, arena_slots: int, policy: Policy, max_model_len: int = 2048,
                 placement: Literal["buddy", "exact"] = "buddy") -> None:
        if policy not in ("max", "pow2", "oracle"):
            raise ValueError(f"policy must be 'max', 'pow2' or 'oracle', got {policy!r}")
        if placement not in ("buddy", "exact"):
            raise ValueError(f"placement must be 'buddy' or 'exact', got {placement!r}")
        self.policy = policy
        self.placement = placement
        self.max_model_len = max_model_len
        self.arena = BuddyAllocator(arena_slots)
        self.tables: dict[int, Reservation] = {}

    @property
    def total_slots(self) -> int:
        return self.arena.total

    def reservation_size(self, prompt_len: int, output_len: int) -> int:
        """Slots Orca reserves for a request (§6.1): the maximum length (Max), the prompt plus the output rounded up
        to a power of two (Pow2: "over-reserves the space for outputs by at most 2x"), or the true length (Oracle).
        """
        if self.policy == "max":
            return self.max_model_len
        if self.policy == "pow2":  # never beyond the model's maximum: no request can use more
            return min(prompt_len + next_pow2(output_len), max(self.max_model_len, prompt_len + output_len))
        return prompt_len + output_len

    def _size_of(self, group) -> int:
        return self.reservation_size(group.seqs[0].get_prompt_len(), group.sampling_params.max_tokens)

    @property
    def num_used_gpu_blocks(self) -> int:
        """Slots held by reservations (the buddy blocks' slack included)."""
        return self.arena.total - self.arena.num_free

    def check_request(self, final_len: int, size: int, n: int = 1) -> None:
        """Raise ValueError, naming the limit, for a request that could never be reserved."""
        if final_len < 1:
            raise ValueError(f"a request needs at least 1 token, got {final_len}")
        if final_len > self.max_model_len:
            raise ValueError(f"request of {final_len} tokens exceeds the model maximum max_model_len="
                             f"{self.max_model_len}")
        if next_pow2(size) > self.arena.max_block or n * next_pow2(size) > self.arena.total:
            raise ValueError(f"request reserves {n} x {size} slots but the arena of {self.arena.total} slots "
                             "has no such free space even when empty")

    # ------------------------------------------------------------------------------------------ group API
    def never_reason(self, group) -> str:
        try:
            self.check_request(group.max_total_len, self._size_of(group), len(group.get_seqs("waiting")))
        except ValueError as e:
            return str(e)
        return "request can never fit in the KV cache"

    def check_group_blocks(self, num_blocks: int, what: str) -> None:
        """Nothing to check: admission already checks a group's whole reservation (``check_request``)."""

    def can_allocate(self, group) -> AllocStatus:
        seqs = group.get_seqs("waiting")
        size = self._size_of(group)
        try:
            self.check_request(group.max_total_len, size, len(seqs))
        except ValueError:
            return AllocStatus.NEVER
        return AllocStatus.OK if self._can_reserve(size, len(seqs)) else AllocStatus.LATER

    def _can_reserve(self, size: int, n: int) -> bool:
        if n == 1:
            return self.arena.can_alloc(size)
        taken = []  # try for real, then roll back
        try:
            for _ in range(n):
                taken.append(self._reserve(size))
            return True
        except MemoryError:
            return False
        finally:
            for r in taken:
                self._release(r)

    def _reserve(self, size: int) -> Reservation:
        if self.placement == "exact":
            return Reservation(self.arena.alloc_exact(size), size, size)
        return Reservation([self.arena.alloc(size)], size, next_pow2(size))

    def _release(self, r: Reservation) -> None:
        for p in r.pieces:
            self.arena.free(p)

    def allocate_group(self, group) -> int:
        """One reservation per sequence (no sharing, no prefix cache: nothing is cached, returns 0)."""
        size = self._size_of(group)
        for s in group.get_seqs("waiting"):
            r = self._reserve(size)
            r.num_tokens = s.get_len()
            self.tables[s.seq_id] = r
        return 0

    def block_table(self, seq_id: int, num_tokens: int | None = None) -> list[int]:
        r = self.tables[seq_id]
        n = r.reserved if num_tokens is None else min(r.reserved, num_tokens)  # block size 1: a slot per token
        return list(range(r.pieces[0], r.pieces[0] + n))

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        first = self.tables[seq_id].pieces[0]
        return list(range(first + start, first + end))

    def num_tokens(self, seq_id: int) -> int:
        return self.tables[seq_id].num_tokens

    def location(self, seq_id: int) -> tuple[str, int] | None:
        r = self.tables.get(seq_id)
        return None if r is None else ("gpu", r.num_tokens)

    def seq_ids(self) -> list[int]:
        """The sequences holding a reservation, sorted."""
        return sorted(self.tables)

    def prefix_digests(self, seq_id: int) -> list[bytes]:
        """None: a contiguous reservation caches no prefix."""
        return []

    def pieces(self, seq_id: int) -> list[int]:
        """The offsets of the buddy blocks that make up the sequence's reservation, in address order: one block
        (buddy placement), or the fewest aligned pieces of exactly its size (exact placement, §6.1's Oracle)."""
        return list(self.tables[seq_id].pieces)

    def free_spans(self) -> list[tuple[int, int]]:
        """The arena's free buddy blocks as ``(offset, slots)``, sorted: its external fragmentation (§2.3)."""
        return sorted((off, 1 << o) for o, offs in self.arena.free_lists.items() for off in offs)

    def cache_layout(self) -> tuple[int, int, int]:
        return self.total_slots, self.block_size, 0

    def stats(self, final_len: dict[int, int] | None = None) -> KVStats:
        """A snapshot of the device memory (``memory.accounting.KVStats``; see ``BlockManager.stats``)."""
        return contiguous_stats(self, final_len or {})

    def pool_counts(self) -> PoolCounts:
        """The arena's slots in all and free (block size 1); no CPU pool, no prefix cache."""
        return PoolCounts(self.arena.total, self.arena.num_free, 0, 0)

    def block_view(self, pool: str = "gpu") -> None:
        """No blocks to draw: one contiguous reservation per sequence."""
        return None

    def num_filled_slots(self) -> int:
        return sum(r.num_tokens for r in self.tables.values())

    def fork_into(self, parent_id: int, child_id: int) -> BlockCopies:
        """No block tables to share: the parent's filled slots are copied into the child's reservation, as HF's
        ``_reorder_cache`` does; returns that copy, one run of slots (block size 1)."""
        parent, child = self.tables[parent_id], self.tables[child_id]
        n = min(parent.num_tokens, child.reserved)
        child.num_tokens = parent.num_tokens
        return [(parent.pieces[0], child.pieces[0], n)] if n else []

    def can_append_slots(self, group) -> bool:
        for s in group.get_seqs("running"):
            r = self.tables[s.seq_id]
            if r.num_tokens >= r.reserved:
                return False
        return True

    def append_slots(self, group) -> BlockCopies:
        for s in group.get_seqs("running"):
            r = self.tables[s.seq_id]
            if r.num_tokens >= r.reserved:
                raise ValueError(f"sequence {s.seq_id} outgrew its reservation of {r.reserved} slots")
            r.num_tokens += 1
        return []

    def decode_room(self, seqs: list[SeqView], limit: int) -> int:
        """Decode steps in a row (at most ``limit``) that fit in these sequences' reservations."""
        for s in seqs:
            r = self.tables[s.seq_id]
            limit = min(limit, r.reserved - r.num_tokens)
        return max(limit, 0)

    def advance(self, seqs: list[SeqView], steps: int) -> None:
        """``steps`` decode steps at once: each reservation gains ``steps`` tokens (``decode_room``)."""
        for s in seqs:
            self.tables[s.seq_id].num_tokens += steps

    def free_seq(self, seq) -> None:
        r = self.tables.pop(seq.seq_id, None)
        if r is not None:
            self._release(r)

    def can_swap_out(self, group) -> bool:
        return False  # Orca reserves up front and never preempts

    def swap_out_group(self, group) -> BlockMoves:
        raise ValueError("a contiguous KV manager has no CPU pool: Orca never preempts")

    def swap_in_status(self, group) -> AllocStatus:
        return AllocStatus.NEVER  # nothing is ever swapped out

    def can_swap_in_group(self, group) -> bool:
        return False

    def swap_in_group(self, group) -> BlockMoves:
        raise ValueError("a contiguous KV manager has no CPU pool: Orca never preempts")

    def check_invariants(self) -> None:
        a = self.arena
        used = sum(1 << o for o in a.allocated.values())
        free = sum(len(s) << o for o, s in a.free_lists.items())
        assert used == a.used and used + free == a.total, "arena slots lost or double counted"
        held = sum(r.reserved if self.placement == "exact" else next_pow2(r.reserved) for r in self.tables.values())
        assert used == held, "allocated slots differ from reservations"


# ------------------------------------------------------------------------------ Fig. 2's accounting (§3)
def contiguous_stats(m: ContiguousKVManager, final_len: dict[int, int]) -> KVStats:
    """``KVStats`` of a ``ContiguousKVManager``: a reservation's slots beyond its tokens are reserved up to the
    request's final length and internal fragmentation after it; a buddy block's rounding slack is external."""
    states = ends = sizes = waste = 0
    for seq_id, r in m.tables.items():
        n, size = r.num_tokens, r.reserved
        end = final_len.get(seq_id, n)
        end = n if end < n else size if end > size else end  # min(max(final, n), size)
        states += n
        ends += end
        sizes += size
        if r.held - n > waste:  # its buddy block (exact placement: the reservation) less its tokens
            waste = r.held - n
    return KVStats(states, ends - states, sizes - ends, m.total_slots - sizes, waste)
