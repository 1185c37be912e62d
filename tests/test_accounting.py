"""Fig. 2's four-way classification of KV slots (``memory/accounting.py``, paper §3) against breakdowns computed by
hand: the paged manager without sharing (its fast path) and with copy-on-write sharing, and Orca's contiguous
reservations."""
from pagedattn.memory.accounting import breakdown, max_request_waste
from pagedattn.memory.per_sequence import PerSequence
from pagedattn.sequence import SequenceGroup
from factories import block_manager, contiguous_manager
from seq_groups import make_group


def as_tuple(b):
    return b.token_states, b.reserved, b.internal, b.external


def test_paged_without_sharing():
    """Block size 4, 10 blocks (40 slots):
    seq 0: 6 tokens, will end at 7: blocks [4 | 2 + 1 reserved + 1 internal];
    seq 1: 3 tokens, will end at 10: one block [3 + 1 reserved] (the next block is not allocated yet);
    seq 2: 8 tokens, done: [4 | 4].
    5 blocks used: 17 token states, 2 reserved, 1 internal, 20 free."""
    m = block_manager(block_size=4, num_gpu_blocks=10, watermark=0.0)
    per_seq = PerSequence(m)
    for seq, n in ((0, 6), (1, 3), (2, 8)):
        per_seq.allocate(seq, n)
    assert as_tuple(breakdown(m, {0: 7, 1: 10, 2: 8})) == (17, 2, 1, 20)


def test_paged_with_copy_on_write_sharing():
    """Seq 0 has 6 tokens in blocks [a | b]; seq 1 is its fork, and its 7th token copied b on write to c.
    Both end at 7 tokens. a (shared): 4 states. b: 2 states + 1 reserved (seq 0's 7th token) + 1 internal.
    c: 3 states + 1 internal. 3 blocks used: 9 / 1 / 2, and 28 free slots."""
    m = block_manager(block_size=4, num_gpu_blocks=10, watermark=0.0)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 6)
    per_seq.fork(0, 1)
    assert per_seq.append_slot(1) is not None  # copy-on-write
    assert as_tuple(breakdown(m, {0: 7, 1: 7})) == (9, 1, 2, 28)


def test_a_shared_block_is_reserved_for_its_longest_sharer():
    """Seq 0 (6 tokens, blocks [a | b]) and its fork share both blocks. Seq 0 will reach 12 tokens, the fork only 7:
    b's two empty slots are reserved (seq 0 fills them), not internal, whichever sharer is seen last."""
    m = block_manager(block_size=4, num_gpu_blocks=10, watermark=0.0)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 6)
    per_seq.fork(0, 1)
    assert as_tuple(breakdown(m, {0: 12, 1: 7})) == (6, 2, 0, 32)


def group(i: int, prompt_len: int, max_tokens: int) -> SequenceGroup:
    return make_group(f"r{i}", [i], prompt_len, max_tokens=max_tokens)


def test_contiguous_pow2_reservations():
    """Orca (Pow2) reserves prompt + next_pow2(max_tokens) in a 64-slot arena:
    A: prompt 5, max 6 -> 5 + 8 = 13 slots; it will stop after 4 tokens (final 9): 5 states, 4 reserved, 4 internal.
    B: prompt 10, max 3 -> 10 + 4 = 14 slots; final 13: 10 states, 3 reserved, 1 internal.
    Everything else (64 - 27, including the buddy blocks' slack) is external: 15 / 7 / 5 / 37.
    After two decode steps A holds 7 tokens and B 12: 19 / 3 / 5 / 37."""
    m = contiguous_manager(64, "pow2", max_model_len=64)
    a, b = group(0, 5, 6), group(1, 10, 3)
    for g in (a, b):
        m.allocate_group(g)
        g.set_status("waiting", "running")
    final = {0: 9, 1: 13}
    assert as_tuple(breakdown(m, final)) == (15, 7, 5, 37)
    for _ in range(2):
        for g in (a, b):
            m.append_slots(g)
    assert as_tuple(breakdown(m, final)) == (19, 3, 5, 37)


def test_a_sequence_without_a_final_length_reserves_nothing():
    """``final_len`` may omit a sequence (its end unknown): it is taken to end now, so its unfilled slots count as
    internal fragmentation. Seq 0: 6 tokens in 2 blocks of 4 -> 6 / 0 / 2; with a fork sharing both blocks, the same
    slots are counted once."""
    m = block_manager(block_size=4, num_gpu_blocks=10, watermark=0.0)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 6)
    assert as_tuple(breakdown(m, {})) == (6, 0, 2, 32)
    per_seq.fork(0, 1)
    assert as_tuple(breakdown(m, {})) == (6, 0, 2, 32)


def test_contiguous_sequence_without_a_final_length_reserves_nothing():
    """Orca (Oracle) reserves prompt + max_tokens = 5 + 6 = 11 slots; with no final length the request is taken to
    end now: 5 states, 0 reserved, 6 internal, 64 - 11 = 53 external."""
    m = contiguous_manager(64, "oracle", max_model_len=64)
    m.allocate_group(group(0, 5, 6))
    assert as_tuple(breakdown(m, {})) == (5, 0, 6, 53)


def test_max_request_waste_by_hand():
    """Paged, blocks of 8: 10 tokens in 2 blocks waste 6 slots; a 1-token sequence swapped out to the CPU (it would
    waste 7) holds no device slot. Orca (Oracle), 11 slots for 5 tokens: 6 with exact placement, 16 - 5 = 11 in the
    16-slot buddy block. Empty managers waste nothing."""
    m = block_manager(block_size=8, num_gpu_blocks=8, num_cpu_blocks=4)
    per_seq = PerSequence(m)
    assert max_request_waste(m) == 0
    per_seq.allocate(0, 10)
    per_seq.allocate(2, 1)
    per_seq.swap_out([2])
    assert max_request_waste(m) == 6
    for placement, waste in (("exact", 6), ("buddy", 11)):
        c = contiguous_manager(64, "oracle", max_model_len=64, placement=placement)
        assert max_request_waste(c) == 0
        c.allocate_group(group(0, 5, 6))
        assert max_request_waste(c) == waste
