"""The real engine and the simulator make the same scheduling decisions, step by step (issues 27, 49): both are the
engine core (``core.EngineCore``) over the same ``Scheduler`` and KV manager; only the executor differs (a model, or a
step-time model). The engine's model here is a tiny OPT whose LM head is all zeros, so greedy decoding emits token 0,
the simulator's dummy token, and automatic prefix caching hashes the same tokens.

Every request arrives at t = 0 (the engine's clock and the simulator's differ; with no arrivals in between, the
decisions depend on the queues alone) and generates its trace's output length (``ignore_eos``). Each step's record
(``core.StepMetrics``) is compared: its kind, the sequences and requests it runs, its tokens, the blocks in use and
the context slots read, what it preempts, swaps and copies, and the queues. The simulator runs with its fast path on
(runs of steady decode steps, taken without planning each), as every replay of the results does: its records must
still equal the engine's, which plans every step."""
import pytest
import torch

from pagedattn import core

from pagedattn.repro.experiments.common import make_engine, tiny_opt
from pagedattn.sequence import SamplingParams
from pagedattn.repro.sim.simulator import simulate
from pagedattn.repro.workloads.traces import TraceRequest, synthetic_prompt


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


#: the fields of a step's record that the executor does not decide (its clock and duration do)
FIELDS = ("step", "kind", "batch_size", "num_groups", "num_prefill_tokens", "num_batched_tokens", "blocks_used",
          "slots_filled", "num_preempted", "num_blocks_swapped", "num_blocks_copied", "num_running", "num_waiting",
          "num_swapped", "memory_bound")


def record(m) -> tuple:
    return tuple(getattr(m, f) for f in FIELDS)


CASES = {  # name: (system, preemption mode, CPU blocks, shared prefix, automatic prefix caching, KV slots)
    "paged-recompute": ("paged", "recompute", 0, 0, False, 320),
    "paged-swap": ("paged", "swap", 64, 0, False, 320),
    "paged-prefix-caching-swap": ("paged", "swap", 64, 24, True, 320),
    "paged-prefix-caching-recompute": ("paged", "recompute", 0, 24, True, 160),
    "orca-oracle": ("orca_oracle", "recompute", 0, 0, False, 320),
}


@pytest.fixture
def sim_cores(monkeypatch, interpreted_simulator):
    """The engine cores that replays build (``simulate`` keeps no step records but its frame's columns)."""
    cores = []
    init = core.EngineCore.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        cores.append(self)
    monkeypatch.setattr(core.EngineCore, "__init__", spy)
    return cores


@pytest.mark.parametrize("name", list(CASES))
def test_engine_and_simulator_schedule_alike(name, sim_cores, one_thread):
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
    sim_metrics = sim_cores[0].steps
    sim_steps, engine_steps = [record(m) for m in sim_metrics], [record(m) for m in engine.step_metrics]
    assert len(engine_steps) == len(sim_steps) == len(sim.steps)
    for a, b in zip(sim_steps, engine_steps):
        assert a == b, f"simulator {a} vs engine {b} ({FIELDS})"
    if not caching:
        assert sim.steps_in_runs > 0, "the simulator took no runs: its fast path is untested here"
    if mode == "swap":
        assert any(m.num_blocks_swapped for m in sim_metrics), "no swap happened: the case does not test swapping"
    else:
        assert any(m.num_preempted for m in sim_metrics) or system != "paged", "no preemption: the case does not test it"
    if caching:
        assert sim.prefix_hit_rate and sim.prefix_hit_rate == engine.kv.stats().prefix_hit_rate
    assert all(o.outputs[0].token_ids == [0] * r.output_len for r in reqs for o in [outputs[r.request_id]])
    assert engine.kv.num_used_gpu_blocks == 0
