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

from pagedattn.memory.block_manager import BlockManager
from pagedattn.memory.contiguous import ContiguousKVManager

KINDS = ("token_states", "reserved", "internal", "external")


@dataclass
class SlotBreakdown:
    token_states: int
    reserved: int
    internal: int
    external: int


def breakdown(manager: BlockManager | ContiguousKVManager, final_len: dict[int, int]) -> SlotBreakdown:
    """The Fig. 2 classification of the manager's device slots right now."""
    if isinstance(manager, ContiguousKVManager):
        return _contiguous(manager, final_len)
    return _paged(manager, final_len)


def _paged(m: BlockManager, final_len: dict[int, int]) -> SlotBreakdown:
    bs = m.block_size
    device = [(s, t) for s, t in m.tables.items() if t.device == "gpu"]
    allocated = m.gpu.num_used * bs
    if sum(len(t.blocks) for _, t in device) == m.gpu.num_used:  # nothing shared: O(sequences) fast path
        states = sum(t.num_tokens for _, t in device)
        ends = sum(min(len(t.blocks) * bs, max(final_len.get(s, t.num_tokens), t.num_tokens)) for s, t in device)
        return SlotBreakdown(states, ends - states, allocated - ends, m.gpu.num_blocks * bs - allocated)
    filled: dict[int, int] = {}  # physical block -> slots holding tokens
    future: dict[int, int] = {}  # physical block -> slots that some sharer will still fill
    for seq_id, t in device:
        end = max(final_len.get(seq_id, t.num_tokens), t.num_tokens)
        for i, b in enumerate(t.blocks):
            lo = i * bs
            filled[b] = max(filled.get(b, 0), min(bs, max(0, t.num_tokens - lo)))
            future[b] = max(future.get(b, 0), min(bs, max(0, end - lo)))
    states = sum(filled.values())
    reserved = sum(future[b] - filled[b] for b in filled)
    return SlotBreakdown(states, reserved, allocated - states - reserved, m.gpu.num_blocks * bs - allocated)


def _contiguous(m: ContiguousKVManager, final_len: dict[int, int]) -> SlotBreakdown:
    states = reserved = internal = 0
    for seq_id, r in m.tables.items():
        end = min(max(final_len.get(seq_id, r.num_tokens), r.num_tokens), r.reserved)
        states += r.num_tokens
        reserved += end - r.num_tokens
        internal += r.reserved - end
    return SlotBreakdown(states, reserved, internal, m.total_slots - states - reserved - internal)


def max_request_waste(manager: BlockManager | ContiguousKVManager) -> int:
    """The most slots any one request holds beyond its tokens (paged: < one block, §4.2; Orca: its reservation's
    unfilled part, including the buddy block's slack)."""
    if isinstance(manager, ContiguousKVManager):
        from pagedattn.memory.contiguous import next_pow2

        exact = manager.placement == "exact"
        return max(((r.reserved if exact else next_pow2(r.reserved)) - r.num_tokens
                    for r in manager.tables.values()), default=0)
    bs = manager.block_size
    return max((len(t.blocks) * bs - t.num_tokens for t in manager.tables.values() if t.device == "gpu"), default=0)
