"""Swap-in feasibility (paper §4.5; issue 19): a swapped-out group comes back as soon as its distinct blocks and the
blocks its next tokens need fit, not one block per sequence more; a group that could not come back even into an
empty pool is refused at once with an error naming the limit; the watermark stays free. Checked through the
scheduler, against an unbounded pool (hypothesis), our counterpart of vLLM's ``test_swap_in_infeasible``, and the
issue's reproduction in the simulator (the engine's is in tests/test_preemption.py)."""
import copy

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pagedattn.memory import AllocStatus, BlockManager
from pagedattn.memory.per_sequence import PerSequence
from pagedattn.sequence import SequenceGroup
from pagedattn.repro.sim.simulator import simulate
from pagedattn.repro.workloads.traces import TraceRequest
from factories import block_manager, scheduler
from seq_groups import make_group


def group(i: int, prompt_len: int, n: int = 1) -> SequenceGroup:
    return make_group(f"r{i}", [i * 10 + k for k in range(n)], prompt_len, float(i), n=n, max_tokens=8)


def swap_out_grown(kv: BlockManager, g, lengths: list[int]) -> None:
    """Allocate a group's prompt, grow sample ``k`` by ``lengths[k]`` tokens (while the pool has room), give every
    sample the token sampled last (its K/V is the next step's to compute), and swap the group out."""
    kv.allocate_group(g)
    g.set_status("waiting", "running")
    per_seq = PerSequence(kv)
    for q, extra in zip(g.seqs, lengths):
        for _ in range(extra):
            if per_seq.needs_new_block(q.seq_id) and kv.num_free_gpu_blocks == 0:
                break
            q.append_token(q.seq_id)  # the samples diverge
            per_seq.append_slot(q.seq_id, q.token_ids)
        q.append_token(q.seq_id)
    kv.swap_out_group(g)
    g.set_status("running", "swapped")


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("n,num_gpu_blocks", [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("num_tokens", [5, 7, 8])
def test_swap_in_is_refused_only_when_it_really_cannot_fit(caching, n, num_gpu_blocks, num_tokens):
    """Our counterpart of vLLM's ``test_swap_in_infeasible``: blocks of 8; a group swapped out with ``num_tokens``
    tokens per sample comes back into an empty pool iff its tokens plus each sample's next token fit (the samples
    share their full blocks; each writes its own tail). Otherwise a single sequence is refused for good, with an
    error naming the limit, and its blocks are freed; parallel samples are split and recomputed one by one
    (``Scheduler._split_samples``), refused only when one sample alone cannot fit."""
    bs = 8
    kv = block_manager(block_size=bs, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=4, watermark=0.0,
                       enable_prefix_caching=caching)
    g = group(0, num_tokens, n=n)
    swap_out_grown(kv, g, [0] * n)
    need = num_tokens // bs + n * -(-(num_tokens % bs + 1) // bs)  # shared full blocks + each sample's own tail
    s = scheduler(kv, preemption_mode="swap")
    s.split_samples = True  # as the engine's
    s.swapped.append(g)
    out = s.schedule()
    one = -(-(num_tokens + 1) // bs)  # one sample alone: its tokens and the last one sampled
    if need <= num_gpu_blocks:
        assert out.decode_groups == [g] and not out.ignored
    elif n > 1:
        assert s.num_preemptions == {"recompute": 1, "swap": 0} and out.preempted == [g]
        if one <= num_gpu_blocks:  # the first sample is recomputed at once, the other waits
            assert not out.ignored and [c.parent for c in out.prefill_groups + list(s.waiting)] == [g] * n
            assert out.prefill_groups[0].seqs == [g.seqs[0]] and kv.pool_counts().cpu_free == 4
        else:
            assert out.ignored == [g] and f"num_gpu_blocks={num_gpu_blocks}" in g.error and not s.waiting
            assert not kv.seq_ids()
    else:
        assert out.ignored == [g] and f"num_gpu_blocks={num_gpu_blocks}" in g.error
        assert f"grew to {-(-num_tokens // bs)} distinct blocks" in g.error  # the samples' shared blocks once
        c = kv.pool_counts()
        assert not kv.seq_ids() and c.cpu_free == c.cpu_blocks
    kv.check_invariants()


def test_swap_in_waits_for_room_and_keeps_the_watermark_free():
    """LATER, not NEVER, while others hold the room; and the watermark's blocks are never used to swap in."""
    kv = block_manager(block_size=4, num_gpu_blocks=10, num_cpu_blocks=10, watermark=0.1)  # 1 block kept free
    per_seq = PerSequence(kv)
    g = group(0, 6, n=2)  # 2 blocks; the samples' next tokens copy the shared partial block once: 3 in all
    swap_out_grown(kv, g, [0, 0])
    per_seq.allocate(99, 4 * 6)  # 6 blocks held by another request: 4 free
    assert kv.swap_in_status(g) is AllocStatus.OK  # 4 - 3 >= 1
    per_seq.append_slot(99)  # 3 free: swapping in would eat the watermark's block
    assert kv.swap_in_status(g) is AllocStatus.LATER and not kv.can_swap_in_group(g)
    per_seq.free(99)
    assert kv.can_swap_in_group(g)


@settings(max_examples=150, deadline=None)
@given(bs=st.integers(1, 6), num_gpu_blocks=st.integers(1, 10), watermark=st.sampled_from([0.0, 0.2]),
       prompt_len=st.integers(1, 24), lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4))
def test_swapped_group_that_fits_the_empty_pool_always_comes_back(bs, num_gpu_blocks, watermark, prompt_len,
                                                                   lengths):
    """Whatever its samples' lengths and sharing, a swapped-out group comes back into the empty pool exactly when
    its blocks after the next token (measured by doing it in an unbounded pool) fit the pool less the watermark;
    otherwise it is refused at once with an error naming the limit, never left waiting."""
    kv = block_manager(block_size=bs, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=64, watermark=watermark)
    g = group(0, prompt_len, n=len(lengths))
    assume(kv.can_allocate(g) is AllocStatus.OK)
    twin = copy.deepcopy(g)
    swap_out_grown(kv, g, lengths)
    # the same group grown alike in an unbounded pool (each sample by what it grew in ``kv``), swapped in there
    unbounded = block_manager(block_size=bs, num_gpu_blocks=1000, num_cpu_blocks=64)
    swap_out_grown(unbounded, twin, [q.get_len() - prompt_len - 1 for q in g.seqs])
    unbounded.swap_in_group(twin)
    twin.set_status("swapped", "running")
    unbounded.append_slots(twin)
    fits = unbounded.num_used_gpu_blocks <= num_gpu_blocks - kv.watermark_blocks
    s = scheduler(kv, preemption_mode="swap")
    s.split_samples = True  # as the engine's
    s.swapped.append(g)
    out = s.schedule()  # runs the swap-in and the next token's append_slots, or refuses
    if fits:
        assert out.decode_groups == [g] and kv.num_used_gpu_blocks == unbounded.num_used_gpu_blocks
    elif len(lengths) > 1 and not out.ignored:  # parallel samples split, each to be recomputed alone
        assert [c.parent for c in out.prefill_groups + list(s.waiting)] == [g] * len(lengths)
        assert kv.pool_counts().cpu_free == 64 and s.num_preemptions["recompute"] == 1
    elif len(lengths) == 1:
        assert out.ignored == [g] and f"num_gpu_blocks={num_gpu_blocks}" in g.error and not kv.seq_ids()
    else:  # samples refused because one alone can never fit (the watermark's blocks are never given)
        assert out.ignored == [g] and not kv.seq_ids() and not s.waiting and not out.prefill_groups
        assert max(-(-q.get_len() // bs) for q in g.seqs) > num_gpu_blocks - kv.watermark_blocks, g.error
    assert not s.swapped
    kv.check_invariants()


def test_simulator_replays_issue19_to_the_end():
    """Issue 19 in the simulator: 4 blocks of 4 tokens, two n=2 requests; the swapped-out one needed one new block
    per sample to come back, which the pool never had, and the replay stopped ("no progress")."""
    trace = [TraceRequest("A", 0.0, 3, 1), TraceRequest("B", 0.0, 4, 3)]
    r = simulate(trace, "paged", num_slots=16, block_size=4, preemption_mode="swap", num_cpu_blocks=16, n=2,
                 seed=0, max_model_len=64)
    assert r.num_preemptions["swap"] == 1
    assert r.requests["finish_time"].notna().all() and r.requests["error"].isna().all()
