"""The simulator's beam-search model (sim.BeamModel, paper §4.4): forks through the real block manager, Orca's context
copies, their charge, and bad input. Expectations are counted by hand on a tiny case."""
import random

import numpy as np
import pytest

from pagedattn.memory.interface import num_copied
from pagedattn.repro.sim.simulator import BEAM_DISTINCT_PARENTS, BeamModel, CostModel, simulate
from pagedattn.repro.workloads.traces import TraceRequest, make_trace
from factories import block_manager, contiguous_manager
from seq_groups import make_group

# One request: a 4-token prompt (one full block of 4) and 8 output tokens, two beams.
TINY = [TraceRequest("r0", 0.0, 4, 8)]


def tiny(system, distinct_parents, cost=None):
    return simulate(TINY, system, num_slots=64, block_size=4, cost=cost or CostModel(), max_model_len=64,
                    beam=BeamModel(2, distinct_parents))



def step(kv, model: BeamModel, beams, rng, first: bool) -> int:
    """One step of the beam model's forks, applied as the scheduler applies them (``KVManager.fork_into``); the
    K/V tokens copied (none on the paged manager)."""
    forks = model.forks(beams, rng, first)
    return sum(num_copied(kv.fork_into(parent.seq_id, child.seq_id)) for parent, child in forks)

def test_one_parent_per_step_shares_all_but_the_last_block():
    """Step k appends token k's slot (4 + k tokens). With one parent per step the dead beam is re-forked from it, so
    only the copied-on-write last block is private: physical blocks 1 (prompt), 3 while the second block fills, 4
    in the third; with two parents (no fork after the first token) each beam keeps its own blocks: 5 in the third."""
    shared = tiny("paged", 1.0).steps
    apart = tiny("paged", 2.0).steps
    assert shared.physical_blocks.tolist() == [1, 3, 3, 3, 3, 4, 4, 4]
    assert apart.physical_blocks.tolist() == [1, 3, 3, 3, 3, 5, 5, 5]
    assert shared.logical_blocks.tolist() == apart.logical_blocks.tolist() == [2, 4, 4, 4, 4, 6, 6, 6]


def test_copies_are_charged_copy_on_write_blocks_and_orca_context_copies():
    """Paged, one parent: a shared half-full last block is copied on write at steps 2, 3, 4, 6, 7 (5 blocks of 4
    tokens); two parents copy nothing. Orca forks by copying the parent's context after steps 0-6 (4, 5, ..., 10
    tokens: 49), or only after step 0 (4 tokens) with two parents. The step times differ by exactly those copies."""
    cost = CostModel()
    paged = tiny("paged", 1.0).steps.dt.sum() - tiny("paged", 2.0).steps.dt.sum()
    assert paged == pytest.approx(cost.copy_time(5 * 4))
    orca = tiny("orca_oracle", 1.0).steps.dt.sum() - tiny("orca_oracle", 2.0).steps.dt.sum()
    assert orca == pytest.approx(cost.copy_time(49 - 4))
    assert cost.copy_time(10) == pytest.approx(2 * 10 * cost.kv_bytes_per_token / (1.555e12 * cost.bandwidth_efficiency))


def beam_group(n, prompt_len=4, max_tokens=8):
    return make_group("g", range(n), [0] * prompt_len, n=n, max_tokens=max_tokens, ignore_eos=True)


def test_a_step_refork_frees_the_dead_beams_blocks_and_keeps_reference_counts():
    kv = block_manager(block_size=4, num_gpu_blocks=16, watermark=0.0)
    g = beam_group(3)
    kv.allocate_group(g)
    g.set_status("waiting", "running")
    for s in g.seqs:
        s.append_token(0)
    kv.append_slots(g)  # 5 tokens each: a private second block per beam
    assert kv.num_used_gpu_blocks == 4
    copied = step(kv, BeamModel(3, 1.0), g.seqs, random.Random(0), first=False)
    assert copied == 0 and kv.num_used_gpu_blocks == 2  # two dead beams' blocks freed, all three share the parent's
    kv.check_invariants()
    assert len({tuple(kv.block_table(s.seq_id)) for s in g.seqs}) == 1


def test_orca_fork_copies_the_parents_filled_slots():
    kv = contiguous_manager(64, "oracle", 64)
    g = beam_group(2)
    kv.allocate_group(g)  # two reservations of 12 slots, 4 filled
    g.set_status("waiting", "running")
    assert step(kv, BeamModel(2, 1.0), g.seqs, random.Random(0), first=True) == 4
    kv.append_slots(g)
    assert step(kv, BeamModel(2, 2.0), g.seqs, random.Random(0), first=False) == 0  # nobody dies


def test_parents_per_step_have_the_stated_mean():
    rng = random.Random(0)
    model = BeamModel(6, 4.52)
    draws = [model.parents(rng, first=False) for _ in range(4000)]
    counts = [len(p) for p in draws]
    assert set(counts) == {4, 5} and np.mean(counts) == pytest.approx(4.52, abs=0.03)
    assert all(p == sorted(set(p)) and 0 <= p[0] and p[-1] < 6 for p in draws)
    assert model.parents(rng, first=True).__len__() == 1


def test_measured_model_and_its_shifted_band_clip_to_the_width():
    assert BeamModel.measured(6).distinct_parents == BEAM_DISTINCT_PARENTS[6]
    assert BeamModel.measured(2, +1).distinct_parents == 2 and BeamModel.measured(2, -1).distinct_parents == 1


@pytest.mark.parametrize("width, parents, match", [(1, 1.0, "width"), (2.0, 1.0, "width"), (4, 0.5, r"\[1, width=4\]"),
                                                   (4, 4.5, r"\[1, width=4\]")])
def test_bad_beam_models_are_refused(width, parents, match):
    with pytest.raises(ValueError, match=match):
        BeamModel(width, parents)
    with pytest.raises(ValueError, match="measured: \\[2, 4, 6\\]"):
        BeamModel.measured(3)


def test_beam_runs_finish_every_request_and_share_more_than_parallel_sampling():
    """A small paper-scale run: every request finishes, nothing is refused; beams (which share generated history)
    save more memory than parallel samples (which share only the prompt) of the same width."""
    trace = make_trace("alpaca", 60, 30.0, 0)
    beam = simulate(trace, "paged", beam=BeamModel.measured(4), preemption_mode="swap", num_cpu_blocks=2000)
    par = simulate(trace, "paged", n=4, preemption_mode="swap", num_cpu_blocks=2000)
    assert beam.requests.error.isna().all() and beam.requests.finish_time.notna().all()
    assert beam.sharing_saving() > par.sharing_saving() > 0
    orca = simulate(trace, "orca_oracle", beam=BeamModel.measured(4))
    assert orca.requests.finish_time.notna().all() and orca.normalized_latency() > beam.normalized_latency()
