"""The KV-manager interface: what the scheduler, the executor and the rest may ask of a KV manager (paper §4), split
by who asks:

- ``KVAllocator``, the scheduler's (and beam search's): admission, a group's blocks over its life (allocate, append
  with copy-on-write, fork, free), preemption by swapping, and the runs of steady decode steps (§4.2-§4.5);
- ``KVLayout``, the executor's: the cache tensors' shape, each sequence's block table and slot mapping (§4.1);
- ``KVInspector``, everyone else's: where a sequence's blocks are, the memory's breakdown and statistics, the pools'
  counts, a copy of the block tables for display, and the invariants (tests read state only through it).

``KVManager`` is all three. Two managers implement it: ``BlockManager`` (paged: block tables over a pool of
fixed-size blocks, §4.2-§4.5) and ``ContiguousKVManager`` (Orca: one contiguous reservation per sequence, block size
1, §2.3). Everything outside ``memory/`` talks to them only through these protocols, so the same scheduler loop
serves the real engine and the simulator, and a caller never asks which manager it holds.

Sequence groups and sequences are typed by what the managers read of them (``SeqView``, ``GroupView``): this package
imports neither ``sequence.py`` nor torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    from pagedattn.memory.accounting import KVStats

#: the device blocks the executor copies before the forward pass, as runs ``(src, dst, count)``: ``count``
#: consecutive blocks from ``src`` on to ``dst`` on. A copy-on-write copy (§4.4) is a run of one block; a contiguous
#: manager's fork copies the parent's filled slots (blocks of one token) in one run, so that a beam's fork costs one
#: tuple, not one per token (those pairs took about a quarter of an Orca beam-search replay's time)
BlockCopies = list[tuple[int, int, int]]
BlockMoves = dict[int, int]  # {src block: dst block} between the device and the CPU pool


class NoFreeBlocksError(RuntimeError):
    """A pool is exhausted right now (the scheduler preempts; this is not a bad request). Defined here, not in
    ``block_pool`` which raises it, because the simulator compiles ``block_pool`` (``repro.sim.fastsim``) and mypyc
    compiles no subclass of a built-in exception."""


def copy_pairs(copies: BlockCopies) -> list[tuple[int, int]]:
    """The ``(src, dst)`` block pairs of ``copies``, one per block copied (what ``copy_blocks`` takes)."""
    return [(src + i, dst + i) for src, dst, count in copies for i in range(count)]


def num_copied(copies: BlockCopies) -> int:
    """How many blocks ``copies`` copies."""
    return sum(count for _, _, count in copies)


class AllocStatus(Enum):
    """Whether a request's blocks can be allocated now (OK), after others finish (LATER), or never (NEVER)."""

    OK = "ok"
    LATER = "later"
    NEVER = "never"


@dataclass(frozen=True)
class BlockView:
    """A copy of one of a paged manager's pools (the device's unless asked), for drawing it (the tour, the worked
    examples) and for tests: each sequence's ``tables[seq_id] = (blocks, num_tokens)`` in that pool by seq id, every
    block's ``ref_counts`` (the pinned prefixes' references included), the user-marked ``pinned`` prefix blocks
    (§4.4; device only), the ``cached`` blocks (those registered under a prefix digest), sorted, their ``digests``
    (``{block: prefix digest}``; prefix caching, as in vLLM's automatic prefix caching), and the ``free`` blocks in
    the order the pool hands them out (first in, first out, so block tables are not contiguous, Fig. 6; the cached
    ones last, least recently used first)."""

    tables: dict[int, tuple[list[int], int]]
    ref_counts: list[int]
    pinned: list[int]
    cached: list[int]
    digests: dict[int, bytes] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)


class SeqView(Protocol):
    """What a KV manager reads of a sequence (``sequence.Sequence``)."""

    seq_id: int
    token_ids: list[int]

    def get_len(self) -> int: ...


class GroupView(Protocol):
    """What a KV manager reads of a sequence group (``sequence.SequenceGroup``): its sequences in a status
    (``"waiting"``, ``"running"``, ``"swapped"``), its id, and the user-marked shared prefix's length (§4.4)."""

    request_id: str
    prefix_len: int

    def get_seqs(self, status=None) -> Sequence[SeqView]: ...


@dataclass(frozen=True)
class PoolCounts:
    """A manager's pools: device blocks in all and free, CPU (swap) blocks in all and free (slots, for a contiguous
    manager's arena; no CPU pool: 0 and 0), the prefix cache's lookups: full prompt blocks looked up and found, and
    the cached device blocks evicted to make room (least recently used first)."""

    gpu_blocks: int
    gpu_free: int
    cpu_blocks: int
    cpu_free: int
    prefix_queries: int = 0
    prefix_hits: int = 0
    gpu_evictions: int = 0


class KVAllocator(Protocol):
    """The scheduler's view: a group's blocks over its life. A method that raises leaves the manager unchanged."""

    block_size: int

    # ------------------------------------------------------------------------------ admission (§4.3, §4.5)
    def can_allocate(self, group: GroupView) -> AllocStatus:
        """Whether a waiting group's prompt (all its tokens, when recomputing) fits now, later, or never."""
        ...

    def never_reason(self, group: GroupView) -> str:
        """Why a group that ``can_allocate`` (waiting) or ``swap_in_status`` (swapped) calls NEVER can never be
        served: the limit it exceeds, for the request's error."""
        ...

    def check_group_blocks(self, num_blocks: int, what: str) -> None:
        """Raise ValueError when one group that may grow to ``num_blocks`` blocks could never fit, even alone
        (beam search's worst case, §4.4); ``what`` describes the request in the message."""
        ...

    # ---------------------------------------------------------------------------- a group's life (§4.3-§4.5)
    def allocate_group(self, group: GroupView) -> int:
        """Allocate a waiting group's prompt; returns how many of its tokens are already cached (prefix caching)."""
        ...

    def can_append_slots(self, group: GroupView) -> bool:
        """Whether every running sequence of the group can get a slot for one more token now."""
        ...

    def append_slots(self, group: GroupView) -> BlockCopies:
        """Make room for one more token per running sequence; returns the copy-on-write copies (§4.4)."""
        ...

    def fork_into(self, parent_id: int, child_id: int) -> BlockCopies:
        """Make sequence ``child_id`` (which holds blocks) a copy of ``parent_id`` (beam search, §4.4); returns the
        block copies that the executor must perform (none where the child shares the parent's blocks)."""
        ...

    def free_seq(self, seq: SeqView) -> None:
        """Release a sequence's blocks, if it holds any."""
        ...

    def can_swap_out(self, group: GroupView) -> bool: ...

    def swap_out_group(self, group: GroupView) -> BlockMoves:
        """Move a running group's blocks to the CPU pool; returns ``{device block: CPU block}`` (§4.5)."""
        ...

    def swap_in_status(self, group: GroupView) -> AllocStatus:
        """Whether a swapped-out group can come back now, later, or never."""
        ...

    def can_swap_in_group(self, group: GroupView) -> bool: ...

    def swap_in_group(self, group: GroupView) -> BlockMoves:
        """Bring a swapped group back; returns ``{CPU block: device block}``."""
        ...


class KVLayout(Protocol):
    """The executor's view: the shape of the cache tensors and where each token's K/V lives in them (§4.1)."""

    def cache_layout(self) -> tuple[int, int, int]:
        """``(num_device_blocks, block_size, num_cpu_blocks)``: the shape of the KV cache tensors."""
        ...

    def block_table(self, seq_id: int, num_tokens: int | None = None) -> list[int]:
        """The sequence's physical blocks, in logical order; with ``num_tokens``, only those that hold its first
        ``num_tokens`` tokens (the context the attention kernel reads; a contiguous reservation runs further)."""
        ...

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat slots (``block * block_size + offset``) of the sequence's tokens ``start .. end - 1``."""
        ...


class KVInspector(Protocol):
    """Everyone else's view: state read for statistics, display, tests and invariants, never changed."""

    def num_tokens(self, seq_id: int) -> int:
        """Tokens the sequence's blocks hold (its K/V slots in use)."""
        ...

    def location(self, seq_id: int) -> tuple[str, int] | None:
        """``(pool, num_tokens)`` of the sequence's blocks, pool ``"gpu"`` or ``"cpu"``; None when it holds none."""
        ...

    def seq_ids(self) -> list[int]:
        """The sequences that hold blocks, in either pool, sorted (the scheduler frees a finished one's, §4.3)."""
        ...

    def prefix_digests(self, seq_id: int) -> list[bytes]:
        """The prefix digests of the sequence's full blocks, in order (prefix caching: a forked child inherits its
        parent's, §4.4); empty where nothing is cached."""
        ...

    @property
    def num_used_gpu_blocks(self) -> int:
        """Device blocks in use (slots, for block size 1)."""
        ...

    def num_filled_slots(self) -> int:
        """Device slots holding a token's K/V, a shared slot counted once."""
        ...

    def pool_counts(self) -> PoolCounts:
        """The pools' sizes and free blocks, and the prefix cache's lookups (``PoolCounts``)."""
        ...

    def stats(self, final_len: dict[int, int] | None = None) -> KVStats:
        """A snapshot of the device memory: Fig. 2's kinds of slot, the largest waste of one request, the blocks
        sharing saves and the prefix hit rate (``memory.accounting.KVStats``). ``final_len[seq_id]``: a sequence's
        KV length at its end, where known."""
        ...

    def block_view(self, pool: str = "gpu") -> BlockView | None:
        """A copy of the blocks of ``pool`` (``"gpu"``, the device's, or ``"cpu"``, the swap space's, §4.5) as a
        ``BlockView``, for display and tests; None for a manager without blocks."""
        ...

    def check_invariants(self) -> None:
        """Assert the manager's own invariants (tests call it after every step)."""
        ...


class KVDecodeRuns(Protocol):
    """An extension that only the simulator uses (``repro.sim.runs``): runs of steady decode steps, taken at once
    instead of one ``append_slots`` round per step. Both managers implement it; the engine never calls it."""

    def decode_room(self, seqs: list, limit: int) -> int:  # of SeqView (a list: the compiled simulator's loops)
        """How many decode steps in a row, at most ``limit``, the device-resident sequences ``seqs`` can each
        take one more token, in this order every step, with no preemption, copy or refusal (0 where unsure)."""
        ...

    def advance(self, seqs: list, steps: int) -> None:  # of SeqView
        """``steps`` such steps at once (``decode_room``): what ``steps`` rounds of ``append_slots`` over the
        sequences, in this order, would do."""
        ...


class KVManager(KVAllocator, KVLayout, KVInspector, Protocol):
    """A KV manager: all three views (``BlockManager``, ``ContiguousKVManager``)."""
