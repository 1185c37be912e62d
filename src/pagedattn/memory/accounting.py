"""Classify every KV slot into the four kinds of the paper's Fig. 2 (§3).

- **token states**: slots that hold a token's K/V now;
- **reserved**: slots allocated to a request that its future tokens will fill;
- **internal fragmentation**: slots allocated to a request that will never be filled;
- **external fragmentation and free**: slots not allocated to any request.

The four add up to the whole KV budget. Which future slots are "reserved" and which "internal" needs the final length
of each request (known in a trace replay: prompt + output), passed as ``final_len[seq_id]`` (its KV length at the
end: prompt + output tokens). Shared physical blocks (§4.4) are counted once.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

KINDS = ("token_states", "reserved", "internal", "external")


@dataclass
class SlotBreakdown:
    token_states: int
    reserved: int
    internal: int
    external: int


@dataclass(frozen=True)
class KVStats:
    """One snapshot of a KV manager's device memory, what the simulator records every step and the experiments
    read (``KVManager.stats``): Fig. 2's four kinds of slot (§3), the most slots one request wastes (§4.2: under
    one block when paged), and for a paged manager the blocks that Fig. 15's sharing saving compares (§4.4):
    ``physical_blocks`` held by sequences (the pinned prefixes' blocks, held by the manager, excluded) and
    ``logical_blocks``, what the device-resident sequences would hold without sharing. ``prefix_hit_rate``: the
    share of looked-up full prompt blocks found in the prefix cache, None when none was looked up (or the manager
    has no prefix cache). A contiguous manager has no blocks to share: those fields are None."""

    token_states: int
    reserved: int
    internal: int
    external: int
    max_request_waste: int
    physical_blocks: int | None = None
    logical_blocks: int | None = None
    prefix_hit_rate: float | None = None

    @property
    def breakdown(self) -> SlotBreakdown:
        return SlotBreakdown(self.token_states, self.reserved, self.internal, self.external)


class _Manager(Protocol):
    """What this module reads of a KV manager (it imports neither manager: each imports it)."""

    def stats(self, final_len: dict[int, int] | None = None) -> KVStats: ...


class _PagedPool(Protocol):
    """``BlockManager``'s state that its ``KVStats`` count: the block tables, the device pool and the pins."""

    block_size: int
    tables: dict[int, Any]  # seq_id -> block table (``device``, ``blocks``, ``num_tokens``)
    gpu: Any  # the device ``BlockPool`` (``num_used``, ``num_blocks``, ``ref_counts``)
    pinned: list[int]
    prefix_hits: int
    prefix_queries: int


class _Reservations(Protocol):
    """``ContiguousKVManager``'s state that its ``KVStats`` count: the reservations and the arena's size."""

    tables: dict[int, Any]  # seq_id -> reservation (``num_tokens``, ``reserved``, ``held``)

    @property
    def total_slots(self) -> int: ...


def breakdown(manager: _Manager, final_len: dict[int, int]) -> SlotBreakdown:
    """The Fig. 2 classification of the manager's device slots right now."""
    return manager.stats(final_len).breakdown


def max_request_waste(manager: _Manager) -> int:
    """The most slots any one request holds beyond its tokens (paged: < one block, §4.2; Orca: its reservation's
    unfilled part, including the buddy block's slack)."""
    return manager.stats({}).max_request_waste


def paged_stats(m: _PagedPool, final_len: dict[int, int]) -> KVStats:
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


def _shared_blocks(m: _PagedPool, final_len: dict[int, int]) -> tuple[int, int]:
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


def contiguous_stats(m: _Reservations, final_len: dict[int, int]) -> KVStats:
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
