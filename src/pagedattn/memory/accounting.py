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

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedattn.memory.block_manager import BlockManager
    from pagedattn.memory.contiguous import ContiguousKVManager

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


def breakdown(manager: BlockManager | ContiguousKVManager, final_len: dict[int, int]) -> SlotBreakdown:
    """The Fig. 2 classification of the manager's device slots right now."""
    return manager.stats(final_len).breakdown


def max_request_waste(manager: BlockManager | ContiguousKVManager) -> int:
    """The most slots any one request holds beyond its tokens (paged: < one block, §4.2; Orca: its reservation's
    unfilled part, including the buddy block's slack)."""
    return manager.stats({}).max_request_waste


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
    furthest sharer fills them. A block full of one sharer's tokens is full for all (filled and to be filled: every
    slot), so only the blocks past a table's full ones (usually its last) are compared slot by slot."""
    bs = m.block_size
    full: set[int] = set()  # physical blocks that some sharer fills with tokens
    filled: dict[int, int] = {}  # other physical blocks -> slots holding tokens
    future: dict[int, int] = {}  # other physical blocks -> slots that some sharer will still fill
    for seq_id, t in m.tables.items():
        if t.device != "gpu":
            continue
        blocks, n = t.blocks, t.num_tokens
        end = max(final_len.get(seq_id, n), n)
        k = min(len(blocks), n // bs)
        full.update(blocks[:k])
        for i in range(k, len(blocks)):
            b, lo = blocks[i], i * bs
            filled[b] = max(filled.get(b, 0), min(bs, max(0, n - lo)))
            future[b] = max(future.get(b, 0), min(bs, max(0, end - lo)))
    partial = [b for b in filled if b not in full]
    states = bs * len(full) + sum(filled[b] for b in partial)
    return states, sum(future[b] - filled[b] for b in partial)


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
