"""Classify every KV slot into the four kinds of the paper's Fig. 2 (§3).

- **token states**: slots that hold a token's K/V now;
- **reserved**: slots allocated to a request that its future tokens will fill;
- **internal fragmentation**: slots allocated to a request that will never be filled;
- **external fragmentation and free**: slots not allocated to any request.

The four add up to the whole KV budget. Each manager counts its own slots into a ``KVStats`` (``BlockManager.stats``,
``ContiguousKVManager.stats``: the counting reads each one's tables, next to the code that keeps them); this module
holds the kinds and the snapshot's type. Which future slots are "reserved" and which "internal" needs the final length
of each request (known in a trace replay: prompt + output), passed as ``final_len[seq_id]`` (its KV length at the
end: prompt + output tokens). Shared physical blocks (§4.4) are counted once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

KINDS = ("token_states", "reserved", "internal", "external")


@dataclass
class SlotBreakdown:
    token_states: int
    reserved: int
    internal: int
    external: int


class KVStats(NamedTuple):
    """One snapshot of a KV manager's device memory, what the simulator records every step and the experiments
    read (``KVManager.stats``): Fig. 2's four kinds of slot (§3), the most slots one request wastes (§4.2: under
    one block when paged), and for a paged manager the blocks that Fig. 15's sharing saving compares (§4.4):
    ``physical_blocks`` held by sequences (the pinned prefixes' blocks, held by the manager, excluded) and
    ``logical_blocks``, what the device-resident sequences would hold without sharing. ``prefix_hit_rate``: the
    share of looked-up full prompt blocks found in the prefix cache, None when none was looked up (or the manager
    has no prefix cache). A contiguous manager has no blocks to share: those fields are None. A named tuple, as
    ``core.StepMetrics`` is, which holds one per recorded step."""

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


def breakdown(manager: _Manager, final_len: dict[int, int]) -> SlotBreakdown:
    """The Fig. 2 classification of the manager's device slots right now."""
    return manager.stats(final_len).breakdown


def max_request_waste(manager: _Manager) -> int:
    """The most slots any one request holds beyond its tokens (paged: < one block, §4.2; Orca: its reservation's
    unfilled part, including the buddy block's slack)."""
    return manager.stats({}).max_request_waste
