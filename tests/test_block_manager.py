"""Block manager: unit tests of the paper's mechanisms and a stateful property test of its invariants."""
import copy
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedattn.memory import AllocStatus, BlockManager, BlockPool, NoFreeBlocksError
from pagedattn.memory.per_sequence import PerSequence
from factories import block_manager


def snapshot(m: BlockManager):
    """Everything an operation may change, read through the inspector: both pools' block views (tables, reference
    counts, free lists in order, cached blocks) and each sequence's prefix digests."""
    return m.block_view("gpu"), m.block_view("cpu"), {s: m.prefix_digests(s) for s in m.seq_ids()}


def test_on_demand_allocation_40_tokens_three_blocks():
    m = block_manager(block_size=16, num_gpu_blocks=10)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 40)
    assert len(m.block_table(0)) == 3 and m.num_filled_slots() == 40
    for _ in range(8):  # fills the third block: no new block
        assert per_seq.append_slot(0) is None
    assert len(m.block_table(0)) == 3
    per_seq.append_slot(0)  # 49th token: a new block only now
    assert len(m.block_table(0)) == 4
    per_seq.free(0)
    assert m.num_free_gpu_blocks == 10
    m.check_invariants()


def test_fork_shares_and_copy_on_write_four_samples():
    """Study note exercise 4: four samples share a block; the writer gets a copy, the count goes 4 -> 3."""
    m = block_manager(block_size=16, num_gpu_blocks=10)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 20)  # two blocks, the last one partly filled
    for child in (1, 2, 3):
        per_seq.fork(0, child)
    last = m.block_table(0)[-1]
    assert m.block_view().ref_counts[last] == 4 and m.num_used_gpu_blocks == 2
    copy_ = per_seq.append_slot(2)
    assert copy_ is not None and copy_[0] == last
    refs = m.block_view().ref_counts
    assert refs[last] == 3 and refs[copy_[1]] == 1
    assert m.block_table(2)[-1] == copy_[1] and m.block_table(0)[-1] == last
    assert m.block_table(2)[0] == m.block_table(0)[0]  # the full first block stays shared
    m.check_invariants()
    for s in range(4):
        per_seq.free(s)
    assert m.num_free_gpu_blocks == 10


def test_append_to_full_shared_block_allocates_without_copy():
    m = block_manager(block_size=4, num_gpu_blocks=10)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 8)
    per_seq.fork(0, 1)
    assert per_seq.append_slot(1) is None  # last block full: a fresh block, nothing to copy
    assert m.block_table(1)[:2] == m.block_table(0)
    m.check_invariants()


def test_swap_out_and_in_preserves_sharing():
    m = block_manager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 6)
    per_seq.fork(0, 1)
    per_seq.append_slot(1)
    out = per_seq.swap_out([0, 1])
    assert len(out) == 3 and m.num_free_gpu_blocks == 8
    shared = m.block_table(0)[0]
    assert m.block_view("cpu").ref_counts[shared] == 2  # the shared first block moved once, still shared
    m.check_invariants()
    back = per_seq.swap_in([0, 1])
    assert len(back) == 3 and m.pool_counts().cpu_free == 8
    assert m.block_table(0)[0] == m.block_table(1)[0]
    m.check_invariants()


def test_watermark_and_alloc_status():
    m = block_manager(block_size=16, num_gpu_blocks=100, watermark=0.05)
    per_seq = PerSequence(m)
    assert per_seq.can_allocate_tokens(16 * 95) is AllocStatus.OK
    assert per_seq.can_allocate_tokens(16 * 96) is AllocStatus.NEVER
    per_seq.allocate(0, 16 * 50)
    assert per_seq.can_allocate_tokens(16 * 46) is AllocStatus.LATER


@pytest.mark.parametrize("call,match", [
    (lambda per_seq: per_seq.allocate(9, 3000), "max_model_len=2048"),
    (lambda per_seq: per_seq.allocate(9, 16 * 11), "num_gpu_blocks=10"),
    (lambda per_seq: per_seq.allocate(9, 0), "at least 1 token"),
    (lambda per_seq: per_seq.swap_in([1]), "num_gpu_blocks=10"),
    (lambda per_seq: per_seq.swap_out([0]), "num_cpu_blocks=2"),
])
def test_bad_input_raises_value_error_and_changes_nothing(call, match):
    m = block_manager(block_size=16, num_gpu_blocks=10, num_cpu_blocks=2, max_model_len=2048)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 16 * 3)  # 3 blocks: more than the CPU pool holds
    per_seq.allocate(1, 16 * 2)
    per_seq.swap_out([1])  # seq 1 now on the CPU
    per_seq.allocate(2, 16 * 7)  # the device pool is full: seq 1 cannot come back
    before = snapshot(m)
    with pytest.raises(ValueError, match=match):
        call(per_seq)
    assert snapshot(m) == before
    m.check_invariants()


def test_swap_in_keeps_the_watermark():
    """A swapped group comes back only if, after its blocks and one slot per sequence for the next token, the
    watermark is still free: 10 blocks, watermark 0.2 -> 2 blocks. A 2-sequence group sharing 3 blocks, the last
    one half full, needs 3 + 1 = 4 (one copy-on-write block for the second sample; issue 19), so it returns with
    6 free blocks (6 - 4 = 2) and not with 5."""
    from pagedattn.sequence import SamplingParams, Sequence, SequenceGroup

    m = block_manager(block_size=4, num_gpu_blocks=10, num_cpu_blocks=10, watermark=0.2)
    per_seq = PerSequence(m)
    g = SequenceGroup("r", [Sequence(0, [1] * 10), Sequence(1, [1] * 10)], SamplingParams(n=2))
    m.allocate_group(g)
    g.set_status("waiting", "swapped")
    per_seq.swap_out([0, 1])
    per_seq.allocate(7, 3 * 4)  # 3 blocks taken: 7 free
    assert m.num_free_gpu_blocks == 7 and m.can_swap_in_group(g)
    per_seq.append_slot(7)  # a fourth block: 6 free
    assert m.num_free_gpu_blocks == 6 and m.can_swap_in_group(g)
    per_seq.allocate(8, 4)  # a fifth block: 5 free
    assert m.num_free_gpu_blocks == 5 and not m.can_swap_in_group(g)


def check_moved(before, m: BlockManager, seqs: list[int], mapping: dict[int, int], to_cpu: bool) -> None:
    """A swap mapping agrees with the block tables before and after (§4.5): its keys are exactly the moved
    sequences' distinct source blocks; its values are distinct blocks that were free in the destination pool and
    now carry one reference per moved table entry; every moved table is its old table mapped through it; the source
    blocks lose exactly those references; no other table changes."""
    after = snapshot(m)
    (src_was, dst_was), (src, dst) = [(v[0], v[1]) if to_cpu else (v[1], v[0]) for v in (before, after)]
    entries = Counter(b for s in seqs for b in src_was.tables[s][0])
    assert set(mapping) == set(entries) and len(set(mapping.values())) == len(mapping)
    for b, n in entries.items():
        assert dst_was.ref_counts[mapping[b]] == 0 and dst.ref_counts[mapping[b]] == n
        assert src.ref_counts[b] == src_was.ref_counts[b] - n
    assert m.seq_ids() == sorted(before[2]) and after[2] == before[2]
    for s in m.seq_ids():
        if s in seqs:
            blocks, num_tokens = src_was.tables[s]
            assert dst.tables[s] == ([mapping[b] for b in blocks], num_tokens)
        else:
            pool = 0 if s in before[0].tables else 1
            assert after[pool].tables[s] == before[pool].tables[s]


def test_block_size_must_be_positive():
    for bad in (0, -16):
        with pytest.raises(ValueError, match="block_size"):
            block_manager(block_size=bad, num_gpu_blocks=4)


def test_pool_exhaustion_is_not_a_value_error_and_changes_nothing():
    m = block_manager(block_size=16, num_gpu_blocks=4)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 60)
    before = snapshot(m)
    with pytest.raises(NoFreeBlocksError):
        per_seq.allocate(1, 10)
    assert snapshot(m) == before
    per_seq.append_slot(0)
    per_seq.append_slot(0)
    per_seq.append_slot(0)
    per_seq.append_slot(0)
    with pytest.raises(NoFreeBlocksError):
        per_seq.append_slot(0)


def test_double_free_is_caught():
    m = block_manager(block_size=16, num_gpu_blocks=4)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 10)
    per_seq.free(0)
    with pytest.raises(KeyError):
        per_seq.free(0)
    pool = BlockPool(4, 16)  # under the manager, the pool refuses a second release of a block
    pool.decref(pool.allocate())
    with pytest.raises(RuntimeError, match="double free"):
        pool.decref(0)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random sequences of allocate / append / fork / free / swap keep every invariant."""

    def __init__(self):
        super().__init__()
        self.m = block_manager(block_size=4, num_gpu_blocks=24, num_cpu_blocks=16, watermark=0.0, max_model_len=64)
        self.per_seq = PerSequence(self.m)
        self.next_id = 0
        self.lengths: dict[int, int] = {}

    def _seqs(self, device):
        return [s for s in self.m.seq_ids() if self.m.location(s)[0] == device]

    @rule(n=st.integers(1, 40))
    def allocate(self, n):
        if self.per_seq.can_allocate_tokens(n) is AllocStatus.OK:
            self.per_seq.allocate(self.next_id, n)
            self.lengths[self.next_id] = n
            self.next_id += 1

    @precondition(lambda self: self._seqs("gpu"))
    @rule(data=st.data())
    def append(self, data):
        s = data.draw(st.sampled_from(self._seqs("gpu")))
        if self.lengths[s] >= 64:
            return
        if self.per_seq.needs_new_block(s) and self.m.num_free_gpu_blocks == 0:
            with pytest.raises(NoFreeBlocksError):
                self.per_seq.append_slot(s)
            return
        shared_before = self.m.block_view().ref_counts[self.m.block_table(s)[-1]] > 1 and self.lengths[s] % 4
        c = self.per_seq.append_slot(s)
        assert (c is not None) == bool(shared_before)
        self.lengths[s] += 1

    @precondition(lambda self: self._seqs("gpu"))
    @rule(data=st.data())
    def fork(self, data):
        s = data.draw(st.sampled_from(self._seqs("gpu")))
        self.per_seq.fork(s, self.next_id)
        self.lengths[self.next_id] = self.lengths[s]
        self.next_id += 1

    @precondition(lambda self: self._seqs("gpu") and len(self.m.seq_ids()) >= 2)
    @rule(data=st.data())
    def fork_into(self, data):
        """A beam takes over another's sequence (§4.4): the pools and tables end as ``free`` then ``fork`` leave
        them (the blocks both already share keep their counts; the rest are let go and shared in the same order)."""
        parent = data.draw(st.sampled_from(self._seqs("gpu")))
        child = data.draw(st.sampled_from(sorted(set(self.m.seq_ids()) - {parent})))
        want = copy.deepcopy(self.m)
        PerSequence(want).free(child)
        PerSequence(want).fork(parent, child)
        assert self.m.fork_into(parent, child) == []
        assert snapshot(self.m) == snapshot(want)
        self.lengths[child] = self.lengths[parent]

    @precondition(lambda self: self.m.seq_ids())
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(self.m.seq_ids()))
        self.per_seq.free(s)
        del self.lengths[s]

    @precondition(lambda self: self._seqs("gpu"))
    @rule(data=st.data())
    def swap_out(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self._seqs("gpu")), min_size=1, max_size=3, unique=True))
        before = snapshot(self.m)
        try:
            mapping = self.per_seq.swap_out(seqs)
        except ValueError:
            assert snapshot(self.m) == before
            return
        check_moved(before, self.m, seqs, mapping, to_cpu=True)

    @precondition(lambda self: self._seqs("cpu"))
    @rule(data=st.data())
    def swap_in(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self._seqs("cpu")), min_size=1, max_size=3, unique=True))
        before = snapshot(self.m)
        try:
            mapping = self.per_seq.swap_in(seqs)
        except ValueError:
            assert snapshot(self.m) == before
            return
        check_moved(before, self.m, seqs, mapping, to_cpu=False)

    @invariant()
    def invariants(self):
        self.m.check_invariants()  # refcount == table references, free + used == total, no double entries
        for s, n in self.lengths.items():
            assert self.m.num_tokens(s) == n

    def teardown(self):
        for s in self.m.seq_ids():
            self.per_seq.free(s)
        c = self.m.pool_counts()
        assert c.gpu_free == c.gpu_blocks and c.cpu_free == c.cpu_blocks
        assert not any(self.m.block_view("gpu").ref_counts + self.m.block_view("cpu").ref_counts)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
