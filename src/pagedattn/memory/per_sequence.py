"""The per-sequence view of a paged KV manager, for the tests and the tour's worked examples (paper §4.2-§4.5).

``BlockManager`` has one public API, the ``memory.interface`` protocols: the scheduler works on sequence groups
(``allocate_group``, ``append_slots``, ``fork_into``, ``swap_out_group``...). Those group calls are made of per-sequence
steps, the paper's own vocabulary: allocate a new sequence's prompt blocks on demand (§4.3), fork a child that shares
its parent's blocks (§4.4), append one token's slot, copy-on-write when its last block is shared (§4.4), free a
sequence, and move sequences to the CPU pool and back (§4.5). The manager keeps those steps private; ``PerSequence``
calls them one sequence at a time, so that a test can set up an exact state (Fig. 6's free list, Fig. 8's four
samples) and check each mechanism alone, and the tour can draw it. The engine and the simulator never use it.

Every call is the manager's own step, unchanged: the same checks, the same errors, the same invariants
(``BlockManager.check_invariants``). State is read through the manager itself (``PerSequence.kv``), by the protocols.
"""
from __future__ import annotations

from pagedattn.memory.block_manager import BlockManager
from pagedattn.memory.interface import AllocStatus, BlockMoves

__all__ = ["PerSequence"]


class PerSequence:
    """``kv``'s per-sequence steps: ``allocate``, ``fork``, ``append_slot``, ``free``, ``swap_out``, ``swap_in``,
    and the admission checks of one request (``can_allocate_tokens``, ``check_request``)."""

    def __init__(self, kv: BlockManager) -> None:
        self.kv = kv

    # ------------------------------------------------------------------------------ admission (§4.3, §4.5)
    def check_request(self, num_tokens: int, token_ids=None, prefix_len: int = 0) -> None:
        """Raise ValueError, naming the limit, for a request of ``num_tokens`` that could never be served (given its
        ``token_ids``, the user-marked prefixes it does not share count as taken)."""
        self.kv._check_request(num_tokens, token_ids, prefix_len)

    def can_allocate_tokens(self, num_tokens: int, token_ids=None, prefix_len: int = 0) -> AllocStatus:
        """Whether a prompt of ``num_tokens`` fits now, later, or never (watermark, cached prefix blocks counted)."""
        return self.kv._can_allocate_tokens(num_tokens, token_ids, prefix_len)

    # ------------------------------------------------------------------------ one sequence's life (§4.2-§4.4)
    def allocate(self, seq_id: int, num_tokens: int, token_ids=None, prefix_len: int = 0) -> int:
        """Give a new sequence the blocks of its first ``num_tokens`` tokens (§4.3); with ``token_ids`` and prefix
        caching, reuse the cached blocks of its prefix. Returns the number of tokens already cached."""
        return self.kv._allocate(seq_id, num_tokens, token_ids, prefix_len)

    def fork(self, parent_id: int, child_id: int) -> None:
        """A new child shares every block of its parent: reference counts go up, nothing is copied (§4.4)."""
        self.kv._fork(parent_id, child_id)

    def needs_new_block(self, seq_id: int) -> bool:
        """Whether one more token takes a block: the last block is full, or shared (copy-on-write, §4.4)."""
        kv = self.kv
        return kv.num_tokens(seq_id) % kv.block_size == 0 or kv.block_view().ref_counts[kv.block_table(seq_id)[-1]] > 1

    def append_slot(self, seq_id: int, token_ids=None) -> tuple[int, int] | None:
        """Make room for one more token; returns the ``(src, dst)`` block copy when copy-on-write happened (§4.4).
        With automatic prefix caching, ``token_ids`` (the appended token included) register a block it fills."""
        return self.kv._append_slot(seq_id, token_ids)

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (a block returns to its pool with its last reference); KeyError if none."""
        self.kv._free(seq_id)

    def slot(self, seq_id: int, pos: int) -> int:
        """The flat slot (``block * block_size + offset``) of the sequence's token ``pos`` (§4.1)."""
        return self.kv.slot_mapping(seq_id, pos, pos + 1)[0]

    # -------------------------------------------------------------------------------- swapping (§4.5)
    def next_token_blocks(self, seq_ids: list[int]) -> int:
        """Blocks one more token of each sequence takes: one per full last block, ``k - 1`` for a partly filled
        last block shared by ``k`` of them (what swapping a group back in reserves beside its blocks)."""
        return self.kv._next_token_blocks(seq_ids)

    def swap_out(self, seq_ids: list[int]) -> BlockMoves:
        """Move the sequences' blocks to the CPU pool, each shared block once; returns ``{gpu block: cpu block}``."""
        return self.kv._swap_out(seq_ids)

    def swap_in(self, seq_ids: list[int]) -> BlockMoves:
        """Bring swapped sequences back to the device pool; returns ``{cpu block: gpu block}``."""
        return self.kv._swap_in(seq_ids)
