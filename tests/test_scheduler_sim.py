"""Scheduler and simulated executor: continuous batching, preemption, no leaks, paper-scale Fig. 2 shares."""
import copy

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pagedattn.config import SchedulerConfig
from pagedattn.memory import AllocStatus, BlockManager, BlockPool
from pagedattn.memory.accounting import breakdown
from pagedattn.scheduler import Scheduler
from pagedattn.sequence import SamplingParams, Sequence, SequenceGroup
from pagedattn.sim import SYSTEMS, make_kv_manager, simulate
from pagedattn.workloads import TraceRequest, make_trace


def group(i, prompt_len, max_tokens=8, n=1):
    seqs = [Sequence(i * 10 + k, [1] * prompt_len) for k in range(n)]
    return SequenceGroup(f"r{i}", seqs, SamplingParams(max_tokens=max_tokens), arrival_time=float(i))


def test_fcfs_admission_and_limits():
    kv = BlockManager(block_size=4, num_gpu_blocks=20, watermark=0.0)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, max_model_len=64), kv)
    for i in range(3):
        s.add(group(i, 6))
    out = s.schedule()
    assert [g.request_id for g in out.prefill_groups] == ["r0", "r1"]  # max_num_seqs caps the batch
    out = s.schedule()  # the third waits for a free seat: a decode step runs instead
    assert not out.prefill_groups and [g.request_id for g in out.decode_groups] == ["r0", "r1"]


def test_impossible_request_is_ignored_with_a_message_and_others_run():
    kv = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0, max_model_len=64)
    s = Scheduler(SchedulerConfig(max_model_len=64), kv)
    s.add(group(0, 100))  # longer than max_model_len
    s.add(group(1, 40))  # needs 10 blocks, the pool has 8
    s.add(group(2, 5))
    out = s.schedule()
    assert [g.request_id for g in out.ignored] == ["r0", "r1"]
    assert "max_model_len=64" in out.ignored[0].error and "num_gpu_blocks=8" in out.ignored[1].error
    assert [g.request_id for g in out.prefill_groups] == ["r2"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_is_all_or_nothing_and_latest_first(mode):
    kv = BlockManager(block_size=4, num_gpu_blocks=6, num_cpu_blocks=8, watermark=0.0)
    s = Scheduler(SchedulerConfig(preemption_mode=mode), kv)
    g0, g1 = group(0, 8), group(1, 8)  # 2 blocks each, both last blocks full
    s.add(g0)
    s.add(g1)
    for _ in range(8):  # prefill, then decode steps: each sequence gains a token per step
        out = s.schedule()
        if out.preempted:
            break
        for g in out.scheduled_groups:
            for q in g.get_seqs("running"):
                q.append_token(0)
    assert out.preempted == [g1] and s.num_preemptions[mode] == 1
    assert g1.seqs[0].status == ("waiting" if mode == "recompute" else "swapped")
    assert g1.seqs[0].seq_id not in kv.tables or kv.tables[g1.seqs[0].seq_id].device == "cpu"
    assert (len(out.blocks_to_swap_out) == 3) == (mode == "swap")
    kv.check_invariants()


@pytest.mark.parametrize("system", SYSTEMS)
def test_simulation_finishes_every_request_and_returns_every_block(system):
    trace = make_trace("sharegpt", 60, rate=4.0, seed=1)
    r = simulate(trace, system, num_slots=6000)
    assert r.requests["finish_time"].notna().all() and r.requests["error"].isna().all()
    assert (r.requests["finish_time"] >= r.requests["arrival_time"]).all()
    shares = r.shares(memory_bound_only=False)
    assert sum(shares.values()) == pytest.approx(100)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_simulation_under_pressure_preempts_and_leaks_nothing(mode):
    trace = [TraceRequest(f"r{i}", 0.0, 30 + 7 * i, 60) for i in range(12)]
    kv_holder = {}
    import pagedattn.sim as sim

    orig = sim.make_kv_manager

    def spy(*a, **k):
        kv_holder["kv"] = orig(*a, **k)
        return kv_holder["kv"]

    sim.make_kv_manager = spy
    try:
        r = simulate(trace, "paged", num_slots=640, block_size=16, preemption_mode=mode, num_cpu_blocks=64)
    finally:
        sim.make_kv_manager = orig
    kv = kv_holder["kv"]
    assert sum(r.num_preemptions.values()) > 0
    assert kv.num_free_gpu_blocks == kv.num_gpu_blocks and kv.cpu.num_free == kv.cpu.num_blocks and not kv.tables
    kv.check_invariants()


def test_breakdown_adds_up_and_counts_shared_blocks_once():
    kv = BlockManager(block_size=4, num_gpu_blocks=10, watermark=0.0)
    kv.allocate(0, 6)
    kv.fork(0, 1)
    b = breakdown(kv, {0: 9, 1: 9})
    assert (b.token_states, b.reserved, b.internal, b.external) == (6, 2, 0, 32)


def test_paper_scale_paged_keeps_96pct_token_states_and_wastes_under_a_block():
    trace = make_trace("sharegpt", 300, rate=2.0, seed=0)
    r = simulate(trace, "paged")
    assert r.steps["memory_bound"].any()
    assert r.shares()["token_states"] >= 96
    assert r.steps["max_request_waste"].max() < 16
    orca = simulate(trace, "orca_max")
    assert orca.shares()["token_states"] < 30 and orca.mean_batch() <= 7


def test_unknown_system():
    with pytest.raises(ValueError, match="unknown system"):
        make_kv_manager("tgi", 100)


def test_group_that_cannot_be_swapped_fails_alone_and_frees_its_blocks():
    """Two forked samples must be preempted together, by swapping; with no CPU swap space the request fails with a
    message naming the limit, its blocks return, and the other request keeps running."""
    kv = BlockManager(block_size=4, num_gpu_blocks=6, num_cpu_blocks=0, watermark=0.0)
    s = Scheduler(SchedulerConfig(preemption_mode="recompute"), kv)
    g0, g1 = group(0, 8), group(1, 8, n=2)
    s.add(g0)
    s.add(g1)
    failed = []
    for _ in range(12):
        out = s.schedule()
        failed += out.ignored
        for g in out.scheduled_groups:
            for q in g.get_seqs("running"):
                q.append_token(q.get_len())  # the samples diverge
        if failed:
            break
    assert failed == [g1] and "num_cpu_blocks" in g1.error
    assert all(q.finish_reason == "error" for q in g1.seqs) and g1.seqs[0].seq_id not in kv.tables
    assert s.running == [g0]
    kv.check_invariants()


# ------------------------------------------------------------------ swap-in feasibility (§4.5; issue 19)
def swap_out_grown(kv: BlockManager, g, lengths: list[int]) -> None:
    """Allocate a group's prompt, grow sample ``k`` by ``lengths[k]`` tokens (while the pool has room), give every
    sample the token sampled last (its K/V is the next step's to compute), and swap the group out."""
    kv.allocate_group(g)
    g.set_status("waiting", "running")
    for q, extra in zip(g.seqs, lengths):
        for _ in range(extra):
            if kv.needs_new_block(q.seq_id) and kv.num_free_gpu_blocks == 0:
                break
            q.append_token(q.seq_id)  # the samples diverge
            kv.append_slot(q.seq_id, q.token_ids)
        q.append_token(q.seq_id)
    kv.swap_out_group(g)
    g.set_status("running", "swapped")


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("n,num_gpu_blocks", [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("num_tokens", [5, 7, 8])
def test_swap_in_is_refused_only_when_it_really_cannot_fit(caching, n, num_gpu_blocks, num_tokens):
    """Our counterpart of vLLM's ``test_swap_in_infeasible``: blocks of 8; a group swapped out with ``num_tokens``
    tokens per sample comes back into an empty pool iff its tokens plus each sample's next token fit (the samples
    share their full blocks; each writes its own tail). Otherwise it is refused for good, with an error naming the
    limit, and its blocks are freed."""
    bs = 8
    kv = BlockManager(block_size=bs, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=4, watermark=0.0,
                      enable_prefix_caching=caching)
    g = group(0, num_tokens, n=n)
    swap_out_grown(kv, g, [0] * n)
    need = num_tokens // bs + n * -(-(num_tokens % bs + 1) // bs)  # shared full blocks + each sample's own tail
    s = Scheduler(SchedulerConfig(preemption_mode="swap"), kv)
    s.swapped.append(g)
    out = s.schedule()
    if need <= num_gpu_blocks:
        assert out.decode_groups == [g] and not out.ignored
    else:
        assert out.ignored == [g] and f"num_gpu_blocks={num_gpu_blocks}" in g.error and "distinct" in g.error
        assert not kv.tables and kv.cpu.num_free == kv.cpu.num_blocks
    kv.check_invariants()


def test_swap_in_waits_for_room_and_keeps_the_watermark_free():
    """LATER, not NEVER, while others hold the room; and the watermark's blocks are never used to swap in."""
    kv = BlockManager(block_size=4, num_gpu_blocks=10, num_cpu_blocks=10, watermark=0.1)  # 1 block kept free
    g = group(0, 6, n=2)  # 2 blocks; the samples' next tokens copy the shared partial block once: 3 in all
    swap_out_grown(kv, g, [0, 0])
    kv.allocate(99, 4 * 6)  # 6 blocks held by another request: 4 free
    assert kv.swap_in_status(g) is AllocStatus.OK  # 4 - 3 >= 1
    kv.append_slot(99)  # 3 free: swapping in would eat the watermark's block
    assert kv.swap_in_status(g) is AllocStatus.LATER and not kv.can_swap_in_group(g)
    kv.free(99)
    assert kv.can_swap_in_group(g)


@settings(max_examples=150, deadline=None)
@given(bs=st.integers(1, 6), num_gpu_blocks=st.integers(1, 10), watermark=st.sampled_from([0.0, 0.2]),
       prompt_len=st.integers(1, 24), lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4))
def test_swapped_group_that_fits_the_empty_pool_always_comes_back(bs, num_gpu_blocks, watermark, prompt_len,
                                                                   lengths):
    """Whatever its samples' lengths and sharing, a swapped-out group comes back into the empty pool exactly when
    its blocks after the next token (measured by doing it in an unbounded pool) fit the pool less the watermark;
    otherwise it is refused at once with an error naming the limit, never left waiting."""
    kv = BlockManager(block_size=bs, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=64, watermark=watermark)
    g = group(0, prompt_len, n=len(lengths))
    assume(kv.can_allocate(g) is AllocStatus.OK)
    swap_out_grown(kv, g, lengths)
    unbounded = copy.deepcopy(kv)
    unbounded.gpu = BlockPool(1000, bs)
    unbounded.swap_in_group(g)
    g.set_status("swapped", "running")
    unbounded.append_slots(g)
    g.set_status("running", "swapped")
    fits = unbounded.gpu.num_used <= num_gpu_blocks - kv.watermark_blocks
    s = Scheduler(SchedulerConfig(preemption_mode="swap"), kv)
    s.swapped.append(g)
    out = s.schedule()  # runs the swap-in and the next token's append_slots, or refuses
    if fits:
        assert out.decode_groups == [g] and kv.num_used_gpu_blocks == unbounded.gpu.num_used
    else:
        assert out.ignored == [g] and f"num_gpu_blocks={num_gpu_blocks}" in g.error and not kv.tables
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
