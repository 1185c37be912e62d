"""Orca baselines: the buddy allocator and contiguous reservations (paper §6.1)."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedattn.memory.block_manager import AllocStatus
from pagedattn.memory.contiguous import BuddyAllocator, ContiguousKVManager, next_pow2
from pagedattn.sequence import SamplingParams, Sequence, SequenceGroup


def group(prompt_len, max_tokens, rid="r", seq_id=0):
    return SequenceGroup(rid, [Sequence(seq_id, [1] * prompt_len)], SamplingParams(max_tokens=max_tokens))


def test_arena_is_split_into_aligned_power_of_two_chunks():
    a = BuddyAllocator(15728)
    assert a.num_free == 15728 and a.max_block == 8192
    assert sum(1 << o for o, s in a.free_lists.items() for _ in s) == 15728


def test_orca_max_fits_seven_requests_in_the_paper_arena():
    m = ContiguousKVManager(15728, "max")
    gs = [group(100, 100, str(i), i) for i in range(8)]
    for g in gs[:7]:
        assert m.can_allocate(g) is AllocStatus.OK
        m.allocate_group(g)
    assert m.can_allocate(gs[7]) is AllocStatus.LATER  # the 1392-slot tail cannot hold 2048
    assert m.arena.num_free == 15728 - 7 * 2048
    m.check_invariants()


def test_reservation_sizes_follow_the_paper():
    assert ContiguousKVManager(4096, "max").reservation_size(100, 25) == 2048
    assert ContiguousKVManager(4096, "pow2").reservation_size(100, 25) == 132  # output 25 -> 32 positions
    assert ContiguousKVManager(4096, "oracle").reservation_size(100, 25) == 125


def test_impossible_request_is_never():
    m = ContiguousKVManager(1000, "max")
    assert m.can_allocate(group(10, 10)) is AllocStatus.NEVER  # 2048 > arena
    with pytest.raises(ValueError, match="max_model_len=2048"):
        ContiguousKVManager(4096, "oracle").check_request(3000, 3000)


def test_exact_placement_returns_the_tail():
    a = BuddyAllocator(1024)
    pieces = a.alloc_exact(300)
    assert a.num_free == 1024 - 300 and pieces[0] == 0
    for p in pieces:
        a.free(p)
    assert a.num_free == 1024 and a.free_lists[10] == {0}


def test_double_free_is_caught():
    a = BuddyAllocator(64)
    off = a.alloc(10)
    a.free(off)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(off)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5000), st.lists(st.tuples(st.booleans(), st.integers(1, 700)), max_size=60), st.booleans())
def test_buddy_allocator_never_loses_or_overlaps_slots(total, ops, exact):
    a = BuddyAllocator(total)
    live: list[list[int]] = []
    rng = random.Random(total)
    for is_alloc, size in ops:
        if is_alloc or not live:
            try:
                pieces = a.alloc_exact(size) if exact else [a.alloc(size)]
            except MemoryError:
                continue
            live.append(pieces)
        else:
            for p in live.pop(rng.randrange(len(live))):
                a.free(p)
        spans = sorted((off, off + (1 << o)) for off, o in a.allocated.items())
        spans += sorted((off, off + (1 << o)) for o, s in a.free_lists.items() for off in s)
        spans.sort()
        assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:])), "overlapping blocks"
        assert sum(e - s for s, e in spans) == total, "slots lost"
    for pieces in live:
        for p in pieces:
            a.free(p)
    assert a.num_free == total and a.largest_free() == (1 << (total.bit_length() - 1))


def test_next_pow2():
    assert [next_pow2(n) for n in (1, 2, 3, 25, 32, 33)] == [1, 2, 4, 32, 32, 64]
