"""Orca baselines: the buddy allocator and contiguous reservations (paper §6.1)."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedattn.memory.block_manager import AllocStatus
from pagedattn.memory.contiguous import BuddyAllocator, next_pow2
from pagedattn.sequence import SamplingParams, Sequence, SequenceGroup
from factories import contiguous_manager
from seq_groups import make_group


def group(prompt_len, max_tokens, rid="r", seq_id=0):
    return make_group(rid, [seq_id], prompt_len, max_tokens=max_tokens)


def test_arena_is_split_into_aligned_power_of_two_chunks():
    a = BuddyAllocator(15728)
    assert a.num_free == 15728 and a.max_block == 8192
    assert sum(1 << o for o, s in a.free_lists.items() for _ in s) == 15728


def test_orca_max_fits_seven_requests_in_the_paper_arena():
    m = contiguous_manager(15728, "max")
    gs = [group(100, 100, str(i), i) for i in range(8)]
    for g in gs[:7]:
        assert m.can_allocate(g) is AllocStatus.OK
        m.allocate_group(g)
    assert m.can_allocate(gs[7]) is AllocStatus.LATER  # the 1392-slot tail cannot hold 2048
    assert m.pool_counts().gpu_free == 15728 - 7 * 2048
    m.check_invariants()


def test_reservation_sizes_follow_the_paper():
    assert contiguous_manager(4096, "max").reservation_size(100, 25) == 2048
    assert contiguous_manager(4096, "pow2").reservation_size(100, 25) == 132  # output 25 -> 32 positions
    assert contiguous_manager(4096, "oracle").reservation_size(100, 25) == 125


def test_impossible_request_is_never():
    m = contiguous_manager(1000, "max")
    assert m.can_allocate(group(10, 10)) is AllocStatus.NEVER  # 2048 > arena
    with pytest.raises(ValueError, match="max_model_len=2048"):
        contiguous_manager(4096, "oracle").check_request(3000, 3000)


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


def test_bad_arena_policy_and_placement_are_value_errors():
    with pytest.raises(ValueError, match="arena size must be > 0, got 0"):
        BuddyAllocator(0)
    with pytest.raises(ValueError, match="policy must be 'max', 'pow2' or 'oracle', got 'min'"):
        contiguous_manager(64, "min")
    with pytest.raises(ValueError, match="placement must be 'buddy' or 'exact', got 'best'"):
        contiguous_manager(64, "oracle", placement="best")
    with pytest.raises(ValueError, match="at least 1 token, got 0"):
        contiguous_manager(64, "oracle").check_request(0, 1)


def test_pow2_never_reserves_beyond_the_model_maximum():
    """Prompt 100, output 1000 -> 100 + 1024 = 1124 > max_model_len=1024: the true length 1100 is reserved instead
    (no request can use more); a short output is rounded up as usual (100 + 8)."""
    m = contiguous_manager(4096, "pow2", max_model_len=1024)
    assert m.reservation_size(100, 1000) == 1100 and m.reservation_size(100, 5) == 108


def test_parallel_samples_are_admitted_only_if_every_reservation_fits_and_a_refusal_changes_nothing():
    """n=2 samples of prompt 12 + 8 = 20 slots each reserve a buddy block of 32 each (oracle, 64-slot arena): both
    fit in the empty arena; with one 32-block taken only one would fit, so LATER, and the trial reservation is rolled
    back; 3 samples (96 slots) could never fit."""
    m = contiguous_manager(64, "oracle", max_model_len=64)
    g = SequenceGroup("r", [Sequence(k, [1] * 12) for k in range(2)], SamplingParams(n=2, max_tokens=8))
    assert m.can_allocate(g) is AllocStatus.OK
    m.allocate_group(group(20, 12, "other", 9))  # a reservation of 32 slots, at offset 0
    assert m.pieces(9) == [0] and m.can_allocate(g) is AllocStatus.LATER
    assert m.pool_counts().gpu_free == 32 and m.free_spans() == [(32, 32)]
    g3 = SequenceGroup("s", [Sequence(k, [1] * 12) for k in range(3)], SamplingParams(n=3, max_tokens=8))
    assert contiguous_manager(64, "oracle", max_model_len=64).can_allocate(g3) is AllocStatus.NEVER


def test_a_reservation_is_never_outgrown_and_never_swapped():
    """Oracle reserves prompt 3 + 2 = 5 slots: two appends fill it, a third is refused (Orca never grows a
    reservation), and Orca never preempts."""
    m = contiguous_manager(16, "oracle", max_model_len=16)
    g = group(3, 2)
    m.allocate_group(g)
    g.set_status("waiting", "running")
    for _ in range(2):
        assert m.can_append_slots(g)
        assert m.append_slots(g) == []
    assert m.num_tokens(0) == 5 and not m.can_append_slots(g) and not m.can_swap_out(g)
    with pytest.raises(ValueError, match="outgrew its reservation of 5 slots"):
        m.append_slots(g)
    assert m.block_table(0) == [0, 1, 2, 3, 4]


# ---- mutmut survivors (issue 20): each expectation below is computed by hand from the buddy layout
def test_an_arena_of_12_slots_is_a_chunk_of_8_then_a_chunk_of_4_and_refuses_with_its_numbers():
    """12 = 8 + 4: chunks at offsets 0 and 8. After an 8-slot block, 4 slots are free and a 5-slot request
    (a block of 8) is refused with those numbers; a full arena's largest free block is 0."""
    a = BuddyAllocator(12)
    assert a.free_lists == {3: {0}, 2: {8}} and a._chunk_order == {0: 3, 8: 2}
    assert a.alloc(8) == 0
    with pytest.raises(MemoryError, match=r"^no free buddy block of 8 slots \(free 4 of 12\)$"):
        a.alloc(5)
    assert a.alloc(4) == 8 and a.largest_free() == 0


def test_alloc_exact_keeps_the_fewest_aligned_pieces():
    """12 slots of a 16-slot arena: the lower 8 and the next 4 ([0, 8]); the top 4 (offset 12) go back."""
    a = BuddyAllocator(16)
    assert a.alloc_exact(12) == [0, 8]
    assert a.allocated == {0: 3, 8: 2} and a.free_lists[2] == {12}
    assert a.alloc_exact(4) == [12] and a.allocated[12] == 2


def test_exact_placement_reserves_exactly_and_buddy_placement_a_power_of_two():
    """Oracle, prompt 12 + 8 = 20 slots: buddy placement holds a block of 32, exact placement 20 (16 + 4)."""
    for placement, used in (("buddy", 32), ("exact", 20)):
        m = contiguous_manager(64, "oracle", max_model_len=64, placement=placement)
        assert m.placement == placement
        m.allocate_group(group(12, 8))
        assert m.num_used_gpu_blocks == used and m.pieces(0) == ([0] if placement == "buddy" else [0, 16])
        m.check_invariants()
    m.tables[0].reserved = 19  # corrupted on purpose: check_invariants must name what broke
    with pytest.raises(AssertionError, match="^allocated slots differ from reservations$"):
        m.check_invariants()
    m.arena.allocated[40] = 0  # corrupted on purpose
    with pytest.raises(AssertionError, match="^arena slots lost or double counted$"):
        m.check_invariants()


def test_admission_limits_are_inclusive():
    """A 64-slot arena takes one request of 1 token and one of exactly max_model_len=64 tokens (a block of 64, the
    whole arena); n defaults to one sample."""
    m = contiguous_manager(64, "oracle", max_model_len=64)
    m.check_request(1, 1)
    m.check_request(64, 64)
    m.check_request(40, 40)  # one block of 64; two would not fit
    with pytest.raises(ValueError, match="reserves 2 x 40 slots"):
        m.check_request(40, 40, 2)


def test_never_reason_names_the_sample_count_or_falls_back():
    m = contiguous_manager(64, "oracle", max_model_len=64)
    g3 = SequenceGroup("s", [Sequence(k, [1] * 12) for k in range(3)], SamplingParams(n=3, max_tokens=8))
    assert m.never_reason(g3) == ("request reserves 3 x 20 slots but the arena of 64 slots has no such free space "
                                  "even when empty")
    assert m.never_reason(group(3, 2)) == "request can never fit in the KV cache"


def test_a_finished_sample_is_neither_reserved_nor_grown():
    """n=2, prompt 12 + 8 = 20 slots (a block of 32) in a 32-slot arena: with one sample finished, only the other
    is admitted, reserved and grown; the finished one has no reservation."""
    m = contiguous_manager(32, "oracle", max_model_len=32)
    g = SequenceGroup("r", [Sequence(k, [1] * 12) for k in range(2)], SamplingParams(n=2, max_tokens=8))
    g.seqs[1].finish("stop")
    assert m.can_allocate(g) is AllocStatus.OK
    assert m.allocate_group(g) == 0 and m.seq_ids() == [0]
    g.set_status("waiting", "running")
    assert m.can_append_slots(g) and m.append_slots(g) == [] and m.num_tokens(0) == 13


def test_the_protocol_answers_of_a_contiguous_manager():
    """Block size 1, no CPU blocks; a sequence's location is the GPU with its filled slots; no swapping."""
    m = contiguous_manager(64, "oracle", max_model_len=64)
    g = group(3, 2)
    assert m.location(0) is None
    m.allocate_group(g)
    m.allocate_group(group(4, 1, "q", 1))
    assert m.cache_layout() == (64, 1, 0) and m.location(0) == ("gpu", 3) and m.num_filled_slots() == 7
    assert not m.can_swap_in_group(g)
    for swap in (m.swap_out_group, m.swap_in_group):
        with pytest.raises(ValueError, match="^a contiguous KV manager has no CPU pool: Orca never preempts$"):
            swap(g)
