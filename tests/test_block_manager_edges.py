"""Block manager edge cases that the mutation run (issue 20, ``make mutants``) found untested (paper §4.2-§4.5).

Every expectation is worked out by hand from the paper's rules and the pool's FIFO free list: a fresh pool hands out
blocks 0, 1, 2, ... in order, and a freed block goes to the back of the list."""
import hashlib
import struct

import pytest

from pagedattn.memory import AllocStatus, BlockManager, BlockPool, NoFreeBlocksError
from pagedattn.memory.block_manager import block_hashes
from pagedattn.memory.per_sequence import PerSequence
from pagedattn.sequence import SamplingParams, Sequence, SequenceGroup
from factories import block_manager, scheduler
from seq_groups import admit, make_group


def running_group(m: BlockManager, request_id: str, first_id: int, prompt_len: int, n: int = 1) -> SequenceGroup:
    g = make_group(request_id, [first_id + k for k in range(n)], prompt_len, n=n)
    admit(m, g)
    return g


def test_slot_mapping_is_block_times_size_plus_offset_over_the_given_range():
    m = block_manager(block_size=4, num_gpu_blocks=8)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 3)  # block 0
    per_seq.allocate(1, 10)  # blocks 1, 2, 3
    assert m.slot_mapping(1, 5, 9) == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 3 * 4 + 0]
    assert per_seq.slot(1, 9) == 3 * 4 + 1


def test_filled_slots_count_device_tables_only_and_shared_blocks_once():
    m = block_manager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 6)
    per_seq.swap_out([0])  # the first table in the manager is on the CPU: not counted, and the others still are
    per_seq.allocate(1, 7)
    per_seq.fork(1, 2)  # both of its blocks shared: 7 slots, once
    assert m.num_filled_slots() == 7


def test_swap_out_may_take_every_free_cpu_block():
    m = block_manager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=2)
    g = running_group(m, "a", 0, 8)  # 2 blocks: exactly the CPU pool
    h = running_group(m, "b", 1, 1)
    assert m.can_swap_out(g)
    assert m.swap_out_group(g) == {0: 0, 1: 1}
    assert not m.can_swap_out(h)  # the CPU pool is full now


def test_swap_in_moves_only_the_unfinished_samples():
    """A finished sample holds no blocks: the group's swap-in (and its feasibility check) covers its swapped
    samples only."""
    m = block_manager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    g = running_group(m, "r", 0, 6, n=2)  # gpu blocks 0, 1, shared
    g.seqs[1].finish("stop")
    m.free_seq(g.seqs[1])
    assert m.swap_out_group(g) == {0: 0, 1: 1}
    g.set_status("running", "swapped")
    assert m.swap_in_status(g) is AllocStatus.OK  # 2 blocks + 0 for the next token (its last block has room): fits
    assert "cannot be swapped back" not in m.never_reason(g)
    assert m.swap_in_group(g) == {0: 2, 1: 3}  # gpu 0, 1 went to the back of the free list
    assert m.block_table(0) == [2, 3] and m.location(1) is None


def test_next_token_blocks_counts_a_fresh_block_per_full_tail_and_copies_per_extra_sharer():
    """One more token each: a full last block takes a new block per sequence, even when the full block is shared
    (no copy: nothing in it is written); a partly filled last block shared by k sequences takes k - 1 (§4.4)."""
    m = block_manager(block_size=4, num_gpu_blocks=16)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 8)
    per_seq.fork(0, 1)  # a shared full last block
    per_seq.allocate(2, 6)
    per_seq.fork(2, 3)
    per_seq.fork(2, 4)  # a partly filled last block shared three ways
    per_seq.allocate(5, 7)  # a partly filled last block of its own
    assert per_seq.next_token_blocks([0, 1]) == 2
    assert per_seq.next_token_blocks([2, 3, 4]) == 2
    assert per_seq.next_token_blocks([5]) == 0
    assert per_seq.next_token_blocks([0, 1, 2, 3, 4, 5]) == 4


def test_swap_in_is_refused_when_other_pinned_prefixes_leave_too_little_room():
    """6 blocks of 4; another request's user-marked 8-token prefix stays pinned (2 blocks, §4.4 / Fig. 16). A group
    swapped out with 16 tokens needs its 4 blocks plus 1 for its next token: 5 > 6 - 2, so it can never come back."""
    m = block_manager(block_size=4, num_gpu_blocks=6, num_cpu_blocks=8, watermark=0.0)
    per_seq = PerSequence(m)
    per_seq.allocate(100, 9, token_ids=[7] * 9, prefix_len=8)
    per_seq.free(100)  # its 2 prefix blocks stay pinned
    g = running_group(m, "b", 0, 16)
    m.swap_out_group(g)
    g.set_status("running", "swapped")
    assert m.swap_in_status(g) is AllocStatus.NEVER
    assert "cannot be swapped back" in m.never_reason(g) and "2 held by other pinned prefixes" in m.never_reason(g)


def test_defaults_no_cpu_pool_a_one_percent_watermark_and_no_automatic_caching():
    m = BlockManager(block_size=4, num_gpu_blocks=100)  # the class's own defaults are under test
    per_seq = PerSequence(m)
    assert m.watermark_blocks == 1 and m.pool_counts().cpu_blocks == 0 and m.prefix_hit_rate == 0.0
    per_seq.allocate(0, 12, token_ids=list(range(12)))
    per_seq.allocate(1, 12, token_ids=list(range(12)))  # the same prompt: nothing shared without caching
    assert m.num_used_gpu_blocks == 6 and (m.pool_counts().prefix_queries, m.pool_counts().prefix_hits) == (0, 0)
    with pytest.raises(ValueError, match="num_cpu_blocks=0"):
        per_seq.swap_out([0])
    with pytest.raises(ValueError, match="num_gpu_blocks must be > 0, got 0"):
        block_manager(block_size=4, num_gpu_blocks=0)
    assert PerSequence(block_manager(block_size=4, num_gpu_blocks=1)).can_allocate_tokens(4) is AllocStatus.OK


def test_admission_limits_are_inclusive():
    """A 1-token request, and one of exactly max_model_len tokens that takes the whole pool, are admitted (with or
    without token ids); one more token is never."""
    m = block_manager(block_size=4, num_gpu_blocks=8, watermark=0.0, max_model_len=32)
    per_seq = PerSequence(m)
    for n in (1, 32):
        assert per_seq.can_allocate_tokens(n) is AllocStatus.OK
        assert per_seq.can_allocate_tokens(n, token_ids=[3] * n) is AllocStatus.OK
        per_seq.check_request(n)
        per_seq.check_request(n, token_ids=[3] * n)
    assert per_seq.can_allocate_tokens(33) is AllocStatus.NEVER
    per_seq.allocate(0, 32)
    assert m.num_free_gpu_blocks == 0


def test_a_request_sharing_a_pinned_one_block_prefix_fits_beside_it():
    """4 blocks of 4, no automatic caching. A request marks its 4-token prefix (1 block, pinned, §4.4 / Fig. 16)
    and finishes. A 16-token request with the same marked prefix needs 4 blocks, one of them the pinned one: it
    fits (3 new blocks, 3 free), and shares the pinned block."""
    m = block_manager(block_size=4, num_gpu_blocks=4, watermark=0.0)
    per_seq = PerSequence(m)
    prefix = [5, 6, 7, 8]
    per_seq.allocate(0, 6, token_ids=prefix + [1, 2], prefix_len=4)
    per_seq.free(0)
    assert m.block_view().pinned == [0] and m.num_free_gpu_blocks == 3
    tokens = prefix + list(range(20, 32))
    assert per_seq.can_allocate_tokens(16, tokens, prefix_len=4) is AllocStatus.OK
    assert per_seq.allocate(1, 16, tokens, prefix_len=4) == 4  # 4 tokens' K/V already cached
    assert m.block_table(1)[0] == 0 and m.block_view().ref_counts[0] == 2


def test_block_hashes_are_chained_blake2b_digests_of_little_endian_int64_tokens():
    """The documented formula, computed by hand: h_0 = BLAKE2b-256(tokens of block 0), h_1 = BLAKE2b-256(h_0 ||
    tokens of block 1), each token a little-endian signed 64-bit integer; tokens past the full blocks are ignored."""
    h0 = hashlib.blake2b(struct.pack("<3q", 1, -2, 3), digest_size=32).digest()
    h1 = hashlib.blake2b(h0 + struct.pack("<3q", 4, 5, 6), digest_size=32).digest()
    assert block_hashes([1, -2, 3, 4, 5, 6, 7], 3, 2) == [h0, h1]
    assert block_hashes([4, 5, 6], 3, 1, parent=h0) == [h1]
    assert block_hashes([1, -2, 3], 3, 1) == [h0]  # exactly enough tokens
    with pytest.raises(ValueError, match="2 full blocks of 3 need 6 token ids, got 5"):
        block_hashes([1, 2, 3, 4, 5], 3, 2)


def test_bad_calls_name_the_sequence_and_change_nothing():
    m = block_manager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, max_model_len=6)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 6)
    per_seq.allocate(1, 3)
    per_seq.swap_out([1])
    for call, match in [(lambda: per_seq.allocate(0, 2), "sequence 0 already has a block table"),
                        (lambda: per_seq.fork(1, 0), "sequence 0 already has a block table"),
                        (lambda: per_seq.append_slot(0), "sequence 0 would exceed max_model_len=6"),
                        (lambda: per_seq.append_slot(1), "sequence 1 is swapped out"),
                        (lambda: per_seq.swap_in([0]), "sequence 0 is on gpu, expected cpu")]:
        with pytest.raises(ValueError, match=match):
            call()
    assert m.num_tokens(0) == 6 and m.block_table(0) == [0, 1] and m.num_free_gpu_blocks == 6
    m.check_invariants()


def test_a_group_can_append_while_its_running_samples_new_blocks_fit():
    """Two samples sharing one full block each need a new block for their next token: 2 free is enough, 1 is not;
    a finished sample needs none."""
    m = block_manager(block_size=4, num_gpu_blocks=6, watermark=0.0)
    per_seq = PerSequence(m)
    g = running_group(m, "a", 0, 4, n=2)
    per_seq.allocate(9, 12)  # 3 blocks: 2 free
    assert m.can_append_slots(g)
    per_seq.allocate(10, 1)  # 1 free
    assert not m.can_append_slots(g)
    g.seqs[1].finish("stop")
    m.free_seq(g.seqs[1])
    assert m.can_append_slots(g)


def test_readmission_after_recompute_sizes_the_waiting_samples_only():
    """A group preempted by recomputation (§4.5) comes back with its finished sample (4 tokens) and its unfinished
    one (4 + 5 = 9 tokens, 3 blocks of 4): admission and allocation follow the waiting sample."""
    g = SequenceGroup("r", [Sequence(0, [1] * 4), Sequence(1, [1] * 4)], SamplingParams(n=2))
    g.seqs[0].finish("stop")
    for t in range(5):
        g.seqs[1].append_token(t)
    assert block_manager(block_size=4, num_gpu_blocks=2, watermark=0.0).can_allocate(g) is AllocStatus.NEVER
    m = block_manager(block_size=4, num_gpu_blocks=3, watermark=0.0)
    assert m.can_allocate(g) is AllocStatus.OK
    m.allocate_group(g)
    assert m.seq_ids() == [1] and m.block_table(1) == [0, 1, 2] and m.num_tokens(1) == 9


def test_a_regrown_group_that_can_never_come_back_is_told_the_limit_it_breaks():
    """The same re-admitted group (finished sample first, 9-token waiting sample) in a 2-block pool: the scheduler
    refuses it with the pool limit that its waiting sample breaks (3 blocks of 4 > num_gpu_blocks=2), not a generic
    message computed from the finished sample."""
    g = SequenceGroup("r", [Sequence(0, [1] * 4), Sequence(1, [1] * 4)], SamplingParams(n=2))
    g.seqs[0].finish("stop")
    for t in range(5):
        g.seqs[1].append_token(t)
    s = scheduler(block_manager(block_size=4, num_gpu_blocks=2, watermark=0.0))
    s.add(g)
    assert s.schedule().ignored == [g]
    assert "request of 9 tokens needs 3 blocks of 4 but the whole pool has only num_gpu_blocks=2" in g.error
    assert g.seqs[0].finish_reason == "stop" and g.seqs[1].finish_reason == "error"


def test_a_block_filled_by_a_decode_step_of_a_group_becomes_cached():
    """Automatic prefix caching: the scheduler's ``append_slots`` passes the tokens when the new token fills a
    block, so a 3-token prompt that decodes token 9 caches the block [1, 2, 3, 9]; a new prompt [1, 2, 3, 9, 5]
    finds its first 4 tokens' K/V there."""
    m = block_manager(block_size=4, num_gpu_blocks=8, watermark=0.0, enable_prefix_caching=True)
    per_seq = PerSequence(m)
    g = SequenceGroup("r", [Sequence(0, [1, 2, 3])], SamplingParams())
    m.allocate_group(g)
    g.set_status("waiting", "running")
    g.seqs[0].append_token(9)
    assert m.append_slots(g) == []
    assert m.block_view().digests[0] == block_hashes([1, 2, 3, 9], 4, 1)[0]
    assert per_seq.allocate(1, 5, [1, 2, 3, 9, 5]) == 4 and m.block_table(1)[0] == 0


def test_prefix_caching_without_token_ids_and_a_forked_childs_digests():
    """Admission without token ids looks nothing up (also at block size 1); a forked child inherits its parent's
    prefix digests, so the blocks it fills later are cached under the right chained digest."""
    caching = PerSequence(block_manager(block_size=4, num_gpu_blocks=4, enable_prefix_caching=True))
    assert caching.can_allocate_tokens(8) is AllocStatus.OK
    assert PerSequence(block_manager(block_size=1, num_gpu_blocks=4)).can_allocate_tokens(2) is AllocStatus.OK
    m = block_manager(block_size=4, num_gpu_blocks=8, watermark=0.0, enable_prefix_caching=True)
    per_seq = PerSequence(m)
    tokens = [1, 2, 3, 4, 5, 6]
    per_seq.allocate(0, 6, tokens)
    per_seq.fork(0, 1)
    assert m.prefix_digests(1) == block_hashes(tokens, 4, 1)
    per_seq.append_slot(1)
    per_seq.append_slot(1, tokens + [7, 8])  # the 7th token copied the shared block into block 2; the 8th fills it
    assert m.block_view().digests[2] == block_hashes(tokens + [7, 8], 4, 2)[1]


def test_a_failed_allocation_that_would_revive_evictable_hits_changes_nothing():
    """Automatic caching, 4 blocks of 4. The 9-token prompt T caches blocks 0 and 1; freed, they wait on the
    evictable list, and a plain 8-token prompt takes the free blocks 3 and 2 (FIFO: 3, then the freed 2). T again
    hits blocks 0 and 1, but reviving them takes them off the free list too: it needs 3 blocks with 2 free, and
    fails before touching anything. Once the plain prompt is gone it fits: hits 0, 1 and the least recently freed
    cached block, 3."""
    m = block_manager(block_size=4, num_gpu_blocks=4, enable_prefix_caching=True)
    per_seq = PerSequence(m)
    t = list(range(100, 109))
    per_seq.allocate(0, 9, t)
    per_seq.free(0)
    per_seq.allocate(1, 8, list(range(8)))
    assert m.block_table(1) == [3, 2] and m.num_free_gpu_blocks == 2
    with pytest.raises(NoFreeBlocksError, match="need 3 blocks, 2 free"):
        per_seq.allocate(2, 9, t)
    assert m.location(2) is None and m.num_free_gpu_blocks == 2 and m.block_view().ref_counts == [0, 0, 1, 1]
    m.check_invariants()
    per_seq.free(1)
    assert per_seq.allocate(2, 9, t) == 8 and m.block_table(2) == [0, 1, 3]


def test_allocation_without_token_ids_caches_nothing():
    """A prompt given by its length only (no token ids) cannot be looked up or cached, with automatic caching
    on, or at block size 1 (where a one-token prefix would be a full block)."""
    m = block_manager(block_size=4, num_gpu_blocks=4, enable_prefix_caching=True)
    per_seq = PerSequence(m)
    assert per_seq.allocate(0, 8) == 0 and m.block_table(0) == [0, 1]
    assert not m.block_view().cached and m.pool_counts().prefix_queries == 0
    m = block_manager(block_size=1, num_gpu_blocks=4)
    per_seq = PerSequence(m)
    assert per_seq.allocate(0, 2) == 0 and m.block_table(0) == [0, 1] and not m.block_view().cached


def test_no_prefix_is_marked_unless_asked():
    """Block size 1, no automatic caching: the first token is a full block, but without ``prefix_len`` nothing is
    cached or pinned. A one-token prefix marked by request 0 is pinned (block 0, held by the manager); a
    4-token request that does not mark it cannot share it, so it needs the whole 4-block pool plus the pinned
    block: never."""
    m = block_manager(block_size=1, num_gpu_blocks=4, watermark=0.0)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 3, [5, 6, 7])
    view = m.block_view()
    assert view.pinned == [] and m.pool_counts().prefix_queries == 0 and view.ref_counts == [1, 1, 1, 0]
    per_seq.free(0)
    per_seq.allocate(1, 1, [5], prefix_len=1)
    per_seq.free(1)
    view = m.block_view()
    assert view.pinned == [3] and view.ref_counts == [0, 0, 0, 1]
    assert per_seq.can_allocate_tokens(4, [5, 6, 7, 8]) is AllocStatus.NEVER
    with pytest.raises(ValueError, match="needs 4 blocks of 1, but 1 of the pool's num_gpu_blocks=4 hold "
                                         "user-marked prefixes it does not share"):
        per_seq.check_request(4, [5, 6, 7, 8])


def test_a_request_sharing_a_pinned_prefix_may_use_the_whole_pool():
    """4 blocks of 4; request 0 marks an 8-token prefix: blocks 0 and 1 are pinned. A 16-token request marking
    the same prefix needs 4 blocks, 2 of them the pinned ones: it fits. One with another prefix would need 4
    blocks plus the 2 pinned: never."""
    m = block_manager(block_size=4, num_gpu_blocks=4, watermark=0.0)
    per_seq = PerSequence(m)
    p = list(range(8))
    per_seq.allocate(0, 9, p + [50], prefix_len=8)
    per_seq.free(0)
    assert m.block_view().pinned == [0, 1]
    per_seq.check_request(16, p + list(range(60, 68)), prefix_len=8)
    assert per_seq.can_allocate_tokens(16, p + list(range(60, 68)), prefix_len=8) is AllocStatus.OK
    with pytest.raises(ValueError, match="2 of the pool's num_gpu_blocks=4 hold user-marked prefixes"):
        per_seq.check_request(16, list(range(20, 36)), prefix_len=8)


def test_watermark_counts_the_pinned_prefixes_of_others():
    """10 blocks of 4, watermark 20 % = 2 blocks; request 0 pins a 2-block prefix. A 28-token request with
    another prefix needs 7 blocks: 7 + 2 pinned fit in 10, but 10 - 2 - 7 = 1 block would stay free, under the
    watermark: never (the pool cannot keep its watermark even when everything else is gone)."""
    m = block_manager(block_size=4, num_gpu_blocks=10, watermark=0.2)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 9, list(range(9)), prefix_len=8)
    per_seq.free(0)
    assert per_seq.can_allocate_tokens(28, list(range(100, 128)), prefix_len=8) is AllocStatus.NEVER
    assert per_seq.can_allocate_tokens(24, list(range(100, 124)), prefix_len=8) is AllocStatus.OK  # 10 - 2 - 6 = 2


def test_a_sequence_may_grow_to_exactly_max_model_len():
    m = block_manager(block_size=4, num_gpu_blocks=4, max_model_len=6)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 5)
    per_seq.append_slot(0)
    assert m.num_tokens(0) == 6
    with pytest.raises(ValueError, match="sequence 0 would exceed max_model_len=6"):
        per_seq.append_slot(0)
    assert m.num_tokens(0) == 6


def test_freeing_twice_names_the_sequence():
    m = block_manager(block_size=4, num_gpu_blocks=4)
    per_seq = PerSequence(m)
    per_seq.allocate(3, 2)
    per_seq.free(3)
    with pytest.raises(KeyError, match="sequence 3 has no block table"):
        per_seq.free(3)


def test_never_reason_of_a_request_sharing_a_pinned_prefix_is_the_watermark():
    """10 blocks of 4, watermark 2 blocks; request 0 pins an 8-token prefix (2 blocks). A 36-token request marking
    the same prefix needs 9 blocks, 2 of them the pinned ones: 9 <= 10, so no limit on its size is broken, but
    10 - 9 = 1 block would stay free, under the watermark: never, because of the watermark. A 36-token request
    with another prefix would need 9 blocks plus the 2 pinned ones: never, because of them."""
    m = block_manager(block_size=4, num_gpu_blocks=10, watermark=0.2)
    per_seq = PerSequence(m)
    p = list(range(8))
    per_seq.allocate(0, 9, p + [50], prefix_len=8)
    per_seq.free(0)
    g = SequenceGroup("r", [Sequence(1, p + list(range(60, 88)))], SamplingParams())
    g.prefix_len = 8
    assert m.can_allocate(g) is AllocStatus.NEVER
    assert m.never_reason(g) == "request can never fit in the KV cache (watermark)"
    h = SequenceGroup("s", [Sequence(2, list(range(100, 136)))], SamplingParams())
    h.prefix_len = 8
    assert m.can_allocate(h) is AllocStatus.NEVER
    assert m.never_reason(h) == ("request of 36 tokens needs 9 blocks of 4, but 2 of the pool's num_gpu_blocks=10 "
                                 "hold user-marked prefixes it does not share")


def test_a_group_may_need_every_block_but_the_watermark():
    m = block_manager(block_size=4, num_gpu_blocks=10, watermark=0.2)
    m.check_group_blocks(8, "beam search")
    with pytest.raises(ValueError, match=r"beam search may need 9 blocks of 4, but the pool has only "
                                         r"num_gpu_blocks=10 \(2 kept free\)"):
        m.check_group_blocks(9, "beam search")


def test_location_is_the_device_and_length_of_the_table():
    m = block_manager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=4)
    per_seq = PerSequence(m)
    assert m.location(0) is None
    per_seq.allocate(0, 6)
    assert m.location(0) == ("gpu", 6)
    per_seq.swap_out([0])
    assert m.location(0) == ("cpu", 6)


@pytest.mark.parametrize("watermark", [-0.01, 1.0, float("nan")])
def test_a_watermark_outside_0_1_is_refused(watermark):
    """A negative watermark would report OK for a prompt larger than the free blocks (the allocation then fails);
    1 would refuse every request as never fitting."""
    with pytest.raises(ValueError, match=r"watermark must be a fraction of the pool in \[0, 1\), got"):
        block_manager(block_size=4, num_gpu_blocks=4, watermark=watermark)
    assert block_manager(block_size=4, num_gpu_blocks=4, watermark=0.0).watermark_blocks == 0


# ------------------------------------------------------------------------------------------------ the block pool
def test_pool_limits_and_messages():
    """A pool refuses a negative size or an empty block; sharing a free block and exhausting the pool are errors
    naming the device ("gpu" by default); ``decref`` says whether it freed the block."""
    with pytest.raises(ValueError, match="num_blocks must be >= 0, got -1"):
        BlockPool(-1, 4)
    with pytest.raises(ValueError, match="block_size must be > 0, got 0"):
        BlockPool(2, 0)
    p = BlockPool(2, 4)
    with pytest.raises(RuntimeError, match="gpu block 0 is free; cannot share it"):
        p.incref(0)
    assert (p.allocate(), p.allocate()) == (0, 1)
    with pytest.raises(NoFreeBlocksError, match="all 2 gpu blocks are in use"):
        p.allocate()
    p.incref(0)
    assert p.decref(0) is False and p.decref(0) is True and p.num_free == 1


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: p.ref_counts.__setitem__(0, 1), "a used block is free"),
    (lambda p: (p.allocate(), p.allocate(), p.register(1, b"h"), p.decref(1), p.block_hash.pop(1)),
     "an evictable block has no hash"),
    (lambda p: p.block_hash.__setitem__(0, b"h"), "a plain free block still has a hash"),
    (lambda p: (p.allocate(), p.cached.__setitem__(b"h", 0)), "prefix cache maps disagree"),
])
def test_pool_check_names_the_broken_invariant(corrupt, message):
    p = BlockPool(2, 4)
    p.check()
    corrupt(p)
    with pytest.raises(AssertionError, match=f"^{message}$"):
        p.check()
