"""Parallel samples that cannot be swapped (issue 62): the paper's rule stays the default (§4.5: a one-sequence group
is recomputed, a group of several is swapped), but where the CPU swap space cannot take a group of parallel samples
(none, or too little), or the group could never come back in whole, the engine's scheduler splits it and recomputes
each sample from its prompt and its own tokens (``Scheduler._split_samples``) instead of failing the request. Beam
groups keep swapping (or fail). Checked on the real engine against a roomy pool (greedy: the same tokens) with the
engine's invariants after every step, and on the scheduler alone."""
import pytest
from factories import block_manager, llm_engine, scheduler
from seq_groups import make_group

from pagedattn.sequence import SamplingParams

PROMPTS = [[5 + i, 9, 12 + i, 7, 30 + i, 2, 8, 11, 4, 6 + i, 3, 13] for i in range(6)]


def serve(engine, params: SamplingParams) -> dict[str, list[list[int]]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.error is None, o.error
            if o.finished:
                done[o.request_id] = [c.token_ids for c in o.outputs]
        engine.check_invariants()
    return done


@pytest.mark.parametrize("caching", [False, True])
def test_samples_without_swap_space_are_recomputed_one_by_one_with_the_same_tokens(caching):
    params = SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True)
    want = serve(llm_engine(block_size=4, num_gpu_blocks=256), params)
    tight = llm_engine(block_size=4, num_gpu_blocks=30, num_cpu_blocks=0, enable_prefix_caching=caching,
                       watermark=0.0)
    got = serve(tight, params)
    assert got == want and all(len(t) == 24 for ts in got.values() for t in ts)
    n = tight.scheduler.num_preemptions
    assert n["recompute"] > 0 and n["swap"] == 0
    assert not tight.requests
    if not caching:  # (the prefix cache keeps freed blocks for reuse)
        assert tight.kv.num_used_gpu_blocks == 0


def test_with_swap_space_the_papers_rule_still_swaps_sample_groups():
    params = SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True)
    engine = llm_engine(block_size=4, num_gpu_blocks=30, num_cpu_blocks=256, watermark=0.0)
    serve(engine, params)
    assert engine.scheduler.num_preemptions["swap"] > 0


@pytest.mark.parametrize("beams_last", [False, True])
def test_the_latest_group_is_preempted_samples_split_beams_refused(beams_last):
    """Two groups of two sequences fill a 4-block pool without swap space; each needs a new block per sequence: the
    latest is preempted. Parallel samples are split (recomputed one by one); a beam group still fails."""
    kv = block_manager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=0)
    s = scheduler(kv, preemption_mode="swap")
    s.split_samples = True
    beams, samples = make_group("beams", [1, 2], 8, n=2), make_group("samples", [3, 4], 8, n=2)
    beams.beam_state = object()  # (what beam_search.init_group sets)
    order = [samples, beams] if beams_last else [beams, samples]
    for g in order:
        s.add(g)
    assert s.schedule().prefill_groups == order  # 2 blocks each: the pool is full
    for g in order:
        for q in g.seqs:
            q.append_token(1)
            q.num_computed_tokens = q.get_len() - 1
    out = s.schedule()
    if beams_last:
        assert out.ignored == [beams] and "swap space" in beams.error and out.decode_groups == [samples]
        assert s.num_preemptions == {"recompute": 0, "swap": 0} and not s.waiting
    else:
        assert [c.parent for c in s.waiting] == [samples, samples] and out.preempted == [samples]
        assert [c.seqs for c in s.waiting] == [[q] for q in samples.seqs] and out.decode_groups == [beams]
        assert s.num_preemptions == {"recompute": 1, "swap": 0} and not out.ignored
