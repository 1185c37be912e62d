"""The real engine and the simulator make the same scheduling decisions, step by step (issue 27): both run the same
``Scheduler`` and KV manager, and both hand a step's results to ``Scheduler.update_from_output``; only the forward
pass differs (a model, or a step-time model). The engine's model here is a tiny OPT whose LM head is all zeros, so
greedy decoding emits token 0, the simulator's dummy token, and automatic prefix caching hashes the same tokens.

Every request arrives at t = 0 (the engine's clock and the simulator's differ; with no arrivals in between, the
decisions depend on the queues alone) and generates its trace's output length (``ignore_eos``). Each step's plan is
compared: its kind, the requests it runs, preempts, swaps out and in, the number of block copies, and the queues."""
import pytest
import torch

from pagedattn.memory.interface import num_copied
from pagedattn.repro.experiments.common import make_engine, tiny_opt
from pagedattn.scheduler import Scheduler
from pagedattn.sequence import SamplingParams
from pagedattn.repro.sim import simulate
from pagedattn.repro.workloads import TraceRequest, synthetic_prompt


def zero_head_opt():
    """A tiny OPT whose logits are all 0, so that greedy decoding picks token 0 every time (torch's tie rule)."""
    model = tiny_opt(seed=3, vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     max_position_embeddings=256)
    model.lm_head.weight = torch.nn.Parameter(torch.zeros_like(model.lm_head.weight))
    model.config.tie_word_embeddings = False  # the head is its own (zero) matrix, not the embedding
    return model


def trace(num_requests: int, shared_prefix: int, seed: int) -> tuple[list[TraceRequest], dict[str, list[int]]]:
    """Requests with prompts of 6-40 tokens (a ``shared_prefix``-token prefix in common) and outputs of 3-30."""
    gen = torch.Generator().manual_seed(seed)
    prefix = synthetic_prompt(shared_prefix, 64, seed) if shared_prefix else []
    reqs, prompts = [], {}
    for i in range(num_requests):
        p_len = int(torch.randint(6, 41, (1,), generator=gen))
        out_len = int(torch.randint(3, 31, (1,), generator=gen))
        prompt = (prefix + synthetic_prompt(p_len, 64, seed * 1000 + i))[:max(p_len, shared_prefix + 2)]
        reqs.append(TraceRequest(f"r{i}", 0.0, len(prompt), out_len))
        prompts[f"r{i}"] = prompt
    return reqs, prompts


def plan(out, sched) -> tuple:
    return ("prefill" if out.is_prefill else "decode", tuple(g.request_id for g in out.scheduled_groups),
            tuple(g.request_id for g in out.preempted), tuple(g.request_id for g in out.ignored),
            len(out.blocks_to_swap_out), len(out.blocks_to_swap_in), num_copied(out.blocks_to_copy),
            len(sched.running), len(sched.waiting), len(sched.swapped))


@pytest.fixture
def record_plans(monkeypatch, interpreted_simulator):
    """Every ``Scheduler.schedule`` call's plan, per scheduler."""
    plans: dict[int, list] = {}
    schedule = Scheduler.schedule

    def recording(self):
        out = schedule(self)
        if not out.is_empty():
            plans.setdefault(id(self), []).append(plan(out, self))
        return out

    monkeypatch.setattr(Scheduler, "schedule", recording)
    # the simulator schedules every step here: it takes steady decode steps as runs without scheduling each
    # (``Scheduler.steady_decode_steps``), with the same results (tests/test_sim_golden.py), but no plan to compare
    monkeypatch.setattr(Scheduler, "steady_decode_steps", lambda self, limit, seqs: 0)
    return plans


CASES = {  # name: (system, preemption mode, CPU blocks, shared prefix, automatic prefix caching, KV slots)
    "paged-recompute": ("paged", "recompute", 0, 0, False, 320),
    "paged-swap": ("paged", "swap", 64, 0, False, 320),
    "paged-prefix-caching-swap": ("paged", "swap", 64, 24, True, 320),
    "paged-prefix-caching-recompute": ("paged", "recompute", 0, 24, True, 160),
    "orca-oracle": ("orca_oracle", "recompute", 0, 0, False, 320),
}


@pytest.mark.parametrize("name", list(CASES))
def test_engine_and_simulator_schedule_alike(name, record_plans, one_thread):
    system, mode, cpu_blocks, prefix, caching, num_slots = CASES[name]
    reqs, prompts = trace(24, prefix, seed=len(name))
    block_size, max_len = 8, 128
    kw = dict(max_num_seqs=16, max_num_batched_tokens=256)
    sim = simulate(reqs, system, num_slots, block_size, max_model_len=max_len, preemption_mode=mode,
                   num_cpu_blocks=cpu_blocks, prompts=prompts, enable_prefix_caching=caching, **kw)
    engine = make_engine(zero_head_opt(), "paged_auto" if caching else system, num_slots, block_size, max_len,
                         num_cpu_blocks=cpu_blocks, preemption_mode=mode, **kw)
    for r in reqs:
        engine.add_request(r.request_id, prompts[r.request_id],
                           SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True), arrival_time=0.0)
    outputs = {}
    while engine.has_unfinished_requests():
        for o in engine.step(finished_only=True):
            outputs[o.request_id] = o
    sim_plans, engine_plans = record_plans.values()
    assert len(engine_plans) == len(sim_plans) == len(sim.steps)
    for i, (a, b) in enumerate(zip(sim_plans, engine_plans)):
        assert a == b, f"step {i}: simulator {a} vs engine {b}"
    if mode == "swap":
        assert any(p[4] for p in sim_plans), "no swap happened: the case does not test swapping"
    else:
        assert any(p[2] for p in sim_plans) or system != "paged", "no preemption: the case does not test it"
    if caching:
        assert sim.prefix_hit_rate and sim.prefix_hit_rate == engine.kv.stats().prefix_hit_rate
    assert all(o.outputs[0].token_ids == [0] * r.output_len for r in reqs for o in [outputs[r.request_id]])
    assert engine.kv.num_used_gpu_blocks == 0
