"""Preemption (paper §4.5; Fig. 19, §7.3): what tests/test_engine.py does not already cover.

test_engine.py checks greedy outputs against Hugging Face under recompute and swap preemption at block size 4. Here:

- the same requests with and without memory pressure give the same tokens, in both modes, at block sizes 1 and 16,
  for greedy requests and for seeded parallel sampling (n = 2, forked sequences sharing blocks: always swapped);
- every swap moves exactly the blocks of the preempted (or resumed) groups, as the block tables say, and the
  executor's copies carry the K/V bytes with them;
- 100 swap-out / swap-in cycles of groups lose no block and no byte: ``free + used == total`` in both pools,
  ``check_invariants()``, the CPU pool full again, the device caches bit-identical at the sequences' slots.
"""
from __future__ import annotations

import pytest
import torch

from pagedattn.engine import LLMEngine
from pagedattn.memory import BlockManager
from pagedattn.memory.interface import copy_pairs
from pagedattn.sequence import SamplingParams, SequenceGroup
from factories import llm_engine
from tiny_models import tiny_llama, tiny_opt

import seq_groups


@pytest.fixture(scope="module")
def hf():
    return tiny_opt()


def prompts(n: int = 10, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(k),), generator=g).tolist() for k in torch.randint(2, 30, (n,), generator=g)]


PROMPTS = prompts(8)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED_N2 = [SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=12, ignore_eos=True) for i in range(3)]
REQUESTS = [(p, GREEDY) for p in PROMPTS] + [(p, sp) for p, sp in zip(PROMPTS[:3], SEEDED_N2)]


def serve(engine: LLMEngine, requests) -> dict[str, list[list[int]]]:
    for i, (p, sp) in enumerate(requests):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished})
    return done


def assert_pools_full(kv: BlockManager) -> None:
    kv.check_invariants()
    c = kv.pool_counts()
    assert c.gpu_free + kv.num_used_gpu_blocks == c.gpu_blocks
    assert c.gpu_free == c.gpu_blocks and c.cpu_free == c.cpu_blocks and not kv.seq_ids()


# --------------------------------------------------------------------------------- outputs under pressure
@pytest.fixture(scope="module")
def unpressured(hf):
    """The outputs with a pool so large that nothing is preempted (block size 16)."""
    roomy = llm_engine(hf, block_size=16, num_gpu_blocks=256, preemption_mode="recompute")
    want = serve(roomy, REQUESTS)
    assert sum(roomy.scheduler.num_preemptions.values()) == 0
    return want


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_preemption_never_changes_outputs(hf, unpressured, mode, block_size):
    """Greedy requests and seeded n=2 groups: a pool of ~2-3 requests' worth of slots vs a roomy one."""
    want = unpressured
    slots = 96  # the largest request (29 + 16 tokens; or a 2-sample group) fits, the batch does not
    tight = llm_engine(hf, block_size=block_size, num_gpu_blocks=slots // block_size, preemption_mode=mode,
                       num_cpu_blocks=4096 // block_size)
    got = serve(tight, REQUESTS)
    assert got == want
    n = tight.scheduler.num_preemptions
    assert n[mode] > 0, n
    if mode == "recompute":
        assert n["swap"] > 0  # n=2 groups share blocks: the scheduler swaps them instead of recomputing
    assert max(m.batch_size for m in tight.step_metrics) > 1
    assert_pools_full(tight.kv)


# ----------------------------------------------------------------------- the swap moves the group's blocks
class SwapSpy:
    """Wraps an engine's scheduler and runner: before each schedule, snapshot every block table; at each block move,
    check the mappings against the tables and the copied bytes against the source caches."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.kv, self.runner = engine, engine.kv, engine.runner
        self.swap_outs = self.swap_ins = self.shared = 0
        self._schedule, self._move = engine.scheduler.schedule, engine.runner.move_blocks
        engine.scheduler.schedule = self.schedule
        engine.runner.move_blocks = self.move_blocks

    def schedule(self, now: float = 0.0):
        kv = self.kv
        views = {pool: kv.block_view(pool) for pool in ("gpu", "cpu")}
        self.before = {s: (blocks, pool, [v.digests.get(b) for b in blocks])
                       for pool, v in views.items() for s, (blocks, _) in v.tables.items()}
        self.out = self._schedule(now)
        return self.out

    def check_moved(self, seqs: list[int], m: dict[int, int], dst: str, cow: dict[int, int]) -> None:
        """Each table entry of the moved sequences names the copy of its old block, or a block of ``dst`` that
        already held the same prefix digest (shared, not copied); the copies are exactly of their old blocks. On
        swap-in, the last block may have been copied on write by the next token's append (forks)."""
        assert set(m) <= {b for s in seqs for b in self.before[s][0]}
        digests_now = self.kv.block_view(dst).digests
        for s in seqs:
            old, _, digests = self.before[s]
            new = self.kv.block_table(s)
            for i, b in enumerate(old):
                if b in m:
                    assert new[i] == m[b] or (i == len(old) - 1 and cow.get(m[b]) == new[i])
                else:
                    assert digests[i] is not None and digests_now.get(new[i]) == digests[i]
                    self.shared += 1

    def move_blocks(self, out):
        kv, r = self.kv, self.runner
        src_dev = [c.clone() for c in r.k_caches + r.v_caches]
        src_cpu = [c.clone() for c in r.k_cpu + r.v_cpu]
        if out.blocks_to_swap_out:
            self.swap_outs += 1
            seqs = [s.seq_id for g in out.preempted if g.seqs[0].status == "swapped" for s in g.get_seqs("swapped")]
            assert seqs, "blocks were swapped out but no preempted group is swapped"
            assert all(self.before[s][1] == "gpu" and kv.location(s)[0] == "cpu" for s in seqs)
            self.check_moved(seqs, out.blocks_to_swap_out, "cpu", {})
        if out.blocks_to_swap_in:
            self.swap_ins += 1
            back = [s for s, (_, dev, _) in self.before.items() if dev == "cpu" and kv.location(s)[0] == "gpu"]
            assert back
            self.check_moved(back, out.blocks_to_swap_in, "gpu", dict(copy_pairs(out.blocks_to_copy)))
        self._move(out)
        pairs = [(src_dev, r.k_cpu + r.v_cpu, out.blocks_to_swap_out), (src_cpu, r.k_caches + r.v_caches,
                                                                         out.blocks_to_swap_in)]
        for srcs, dsts, m in pairs:
            for src, dst in zip(srcs, dsts):
                for a, b in m.items():
                    assert torch.equal(dst[b], src[a])


@pytest.mark.parametrize("block_size", [2, 8])
def test_swap_moves_exactly_the_preempted_groups_blocks(hf, block_size):
    engine = llm_engine(hf, block_size=block_size, num_gpu_blocks=96 // block_size, preemption_mode="swap",
                        num_cpu_blocks=2048 // block_size)
    spy = SwapSpy(engine)
    serve(engine, REQUESTS)
    assert spy.swap_outs > 0 and spy.swap_ins > 0
    assert engine.scheduler.num_preemptions["swap"] > 0
    assert_pools_full(engine.kv)


# ------------------------------------------------------------------------------------- 100 swap cycles
def make_group(rid: int, seq_ids: list[int], num_tokens: int) -> SequenceGroup:
    return seq_groups.make_group(f"r{rid}", seq_ids, list(range(3, 3 + num_tokens)), n=len(seq_ids),
                                 temperature=1.0, seed=0)


def test_hundred_swap_cycles_lose_no_block_and_no_byte(hf):
    """Groups (one with forked sequences sharing blocks) are swapped out and in 100 times through the block
    manager's group API and the executor's swap op, growing between cycles: every mapping comes from the manager,
    every byte comes back, and both pools are whole at the end."""
    bs = 4
    engine = llm_engine(hf, block_size=bs, num_gpu_blocks=48, num_cpu_blocks=40, preemption_mode="swap",
                        watermark=0.0)
    kv, runner = engine.kv, engine.runner
    from pagedattn.scheduler import SchedulerOutputs

    groups = [make_group(0, [0], 9), make_group(1, [1, 2], 6), make_group(2, [3], 13)]
    for g in groups:
        kv.allocate_group(g)
        g.set_status("waiting", "running")
    gen = torch.Generator().manual_seed(0)

    def fill_new_slots():  # random K/V at every slot the sequences hold, layer by layer (shared slots once)
        for c in runner.k_caches + runner.v_caches:
            c.copy_(torch.randn(c.shape, generator=gen))

    def contents():
        out = {}
        for g in groups:
            for s in g.get_seqs("running"):
                slots = torch.tensor(kv.slot_mapping(s.seq_id, 0, kv.num_tokens(s.seq_id)))
                out[s.seq_id] = [c.view(-1, *c.shape[2:])[slots].clone() for c in runner.k_caches + runner.v_caches]
        return out

    fill_new_slots()
    for cycle in range(100):
        want = contents()
        victims = [groups[cycle % 3], groups[(cycle + 1) % 3]] if cycle % 2 else [groups[cycle % 3]]
        out = SchedulerOutputs()
        for g in victims:
            out.blocks_to_swap_out.update(kv.swap_out_group(g))
            g.set_status("running", "swapped")
        runner.move_blocks(out)
        kv.check_invariants()
        c = kv.pool_counts()
        assert c.cpu_blocks - c.cpu_free == len({b for g in victims for s in g.seqs for b in kv.block_table(s.seq_id)})
        for c in runner.k_caches + runner.v_caches:  # scribble over the freed device blocks
            c.normal_(generator=gen)
        out = SchedulerOutputs()
        for g in victims:
            assert kv.can_swap_in_group(g)
            out.blocks_to_swap_in.update(kv.swap_in_group(g))
            g.set_status("swapped", "running")
        runner.move_blocks(out)
        kv.check_invariants()
        c = kv.pool_counts()
        assert c.cpu_free == c.cpu_blocks  # the CPU pool is full again
        assert c.gpu_free + kv.num_used_gpu_blocks == c.gpu_blocks
        got = contents()
        for g in victims:
            for s in g.seqs:
                assert all(torch.equal(a, b) for a, b in zip(got[s.seq_id], want[s.seq_id])), (cycle, s.seq_id)
        if cycle % 10 == 9:  # grow: one token per sequence (copy-on-write of shared last blocks included)
            for g in groups:
                kv.append_slots(g)
                for s in g.seqs:
                    s.append_token(7)
            fill_new_slots()
    used = len({b for g in groups for s in g.seqs for b in kv.block_table(s.seq_id)})
    assert kv.num_used_gpu_blocks == used
    for g in groups:
        for s in g.seqs:
            kv.free_seq(s)
    assert_pools_full(kv)


# ------------------------------------------------------------------- swapping blocks shared between groups (§4.5)
def test_groups_sharing_cached_prefix_blocks_swap_them_once_and_match_hf():
    """Issue 12 (1), its reproduction: four prompts share 8 cached prefix blocks; groups swapped out in the same
    step used to overwrite each other's ``{device block: cpu block}`` entries, and one came back reading zeros. A
    shared block is now copied once, shared on the CPU, and shared again on the device."""
    hf = tiny_llama(max_position_embeddings=2048)
    prompts_ = [list(range(10, 74)) + [100 + i] * 7 for i in range(4)]  # equal lengths: HF needs no padding
    with torch.inference_mode():
        want = hf.generate(torch.tensor(prompts_), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[:, 71:].tolist()
    engine = llm_engine(hf, block_size=8, num_gpu_blocks=13, preemption_mode="swap", num_cpu_blocks=64,
                        enable_prefix_caching=True)
    spy = SwapSpy(engine)
    got = serve(engine, [(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for p in prompts_])
    assert [got[str(i)][0] for i in range(4)] == want
    assert engine.scheduler.num_preemptions["swap"] >= 2 and spy.swap_ins > 0 and spy.shared > 0
    assert_pools_full(engine.kv)


def test_issue19_group_with_room_in_its_last_blocks_comes_back(hf):
    """Issue 19, its reproduction: 4 blocks of 4 tokens; B (n=2, a 4-token prompt, 3 new tokens) needs at most 3
    blocks but was swapped out, and waited for 3 + 2 blocks that the pool never has. It now needs no new block
    (its samples' last blocks have room), comes back when A finishes, and its outputs equal an unpressured run."""
    requests = [([5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
                ([8, 9, 10, 11], SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=3, ignore_eos=True))]
    want = serve(llm_engine(hf, block_size=4, num_gpu_blocks=64), requests)
    tight = llm_engine(hf, block_size=4, num_gpu_blocks=4, preemption_mode="swap", num_cpu_blocks=16, watermark=0.0)
    assert serve(tight, requests) == want
    assert tight.scheduler.num_preemptions["swap"] == 1
    assert_pools_full(tight.kv)


# ------------------------------------------------------------------------------ the paper-scale swap cost (Fig. 19)
def test_swap_cost_model_counts_one_copy_per_block_layer_and_kv():
    from pagedattn.scheduler import SchedulerOutputs
    from pagedattn.repro.sim.simulator import CostModel

    c = CostModel(num_layers=40, copy_latency_s=5e-6, pcie_bytes_per_s=32e9, pcie_efficiency=0.8)
    per_copy = 5e-6 + 16 * c.kv_bytes_per_token / 80 / 25.6e9
    assert c.swap_time(3, 16) == pytest.approx(3 * 80 * per_copy)
    # the same bytes in smaller blocks cost more copies: swapping is dearer at small block sizes
    assert c.swap_time(16, 1) > c.swap_time(1, 16) > 0
    # the simulator charges a step's swaps on top of its roofline time (swaps are not free)
    out = SchedulerOutputs(blocks_to_swap_out={0: 1, 2: 3}, blocks_to_swap_in={4: 5})
    no_swap = SchedulerOutputs()
    assert c.step_time(out, 16) == pytest.approx(c.step_time(no_swap, 16) + c.swap_time(3, 16))
