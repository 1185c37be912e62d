"""The experiments' shared toolkit (``pagedattn.repro.experiments.common``): parameters with quick defaults, the CPU model,
scaled traces, a system's engine, trace replay on an injected clock, and timing by the fastest run. Every clock here
is a fake one that the test advances, so nothing depends on wall time."""
from dataclasses import dataclass

import pytest

from pagedattn.repro.experiments import validated
from pagedattn.repro.experiments.common import (Arrival, Clock, ExperimentParams, ServingParams, fastest, greedy,
                                          make_engine, replay, requests_frame, scaled_trace, tiny_opt)
from pagedattn.memory.block_manager import BlockManager
from pagedattn.memory.contiguous import ContiguousKVManager
from pagedattn.repro.workloads.traces import TraceRequest, make_trace


@dataclass
@validated
class _Params(ServingParams):
    sizes: dict = None
    count: int = 5
    QUICK = dict(sizes={"a": 1}, count=2)


def test_params_make_applies_quick_defaults_unless_given():
    assert (_Params.make().count, _Params.make().sizes) == (5, None)
    q = _Params.make(True)
    assert (q.quick, q.count, q.sizes, q.seed, q.block_size) == (True, 2, {"a": 1}, 0, 16)
    assert _Params.make(True, count=7).count == 7
    q.sizes["a"] = 99  # a run's quick values are its own copy
    assert _Params.make(True).sizes == {"a": 1}
    with pytest.raises(ValueError, match="_Params.count must be an integer >= 1"):
        _Params.make(True, count=0)
    assert not hasattr(ExperimentParams(), "block_size")


def test_scaled_trace_rounds_to_nearest_or_up_and_keeps_a_token():
    base = make_trace("alpaca", 50, 2.0, seed=3)
    near, up = scaled_trace("alpaca", 50, 4, 2.0, seed=3), scaled_trace("alpaca", 50, 4, 2.0, seed=3, round_up=True)
    for b, n, u in zip(base, near, up):
        assert (n.request_id, n.arrival_time) == (u.request_id, u.arrival_time) == (b.request_id, b.arrival_time)
        assert n.prompt_len == max(1, round(b.prompt_len / 4)) and u.prompt_len == -(-b.prompt_len // 4)
        assert n.output_len == max(1, round(b.output_len / 4)) and u.output_len == -(-b.output_len // 4)
    assert any(n.prompt_len != u.prompt_len for n, u in zip(near, up))


class _Timer:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture(scope="module")
def model():
    return tiny_opt(0, vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    max_position_embeddings=128)


def test_tiny_opt_shape_and_seed(model):
    c = model.config
    assert (c.hidden_size, c.ffn_dim, c.init_std, c.vocab_size) == (16, 64, 0.2, 64)
    again = tiny_opt(0, vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     max_position_embeddings=128, ffn_dim=32)
    assert again.config.ffn_dim == 32


@pytest.mark.parametrize("system, kind, policy", [("paged", BlockManager, None), ("paged_auto", BlockManager, None),
                                                  ("orca_oracle", ContiguousKVManager, "oracle"),
                                                  ("orca_pow2", ContiguousKVManager, "pow2"),
                                                  ("ft", ContiguousKVManager, "max")])
def test_make_engine_maps_each_system_to_its_manager(model, system, kind, policy):
    e = make_engine(model, system, 512, 16, 128, attention_backend="torch")
    assert isinstance(e.kv, kind)
    assert e.scheduler.static_batching == (system == "ft")
    if kind is BlockManager:
        assert e.kv.num_gpu_blocks == 32 and e.kv.enable_prefix_caching == (system == "paged_auto")
    else:
        assert e.kv.policy == policy
    with pytest.raises(ValueError, match="unknown system"):
        make_engine(model, "tgi", 512)


def test_replay_adds_on_arrival_and_jumps_idle_gaps(model):
    """Each step costs one second of a fake timer; the second request arrives long after the first is done, so the
    clock jumps to its arrival and its latency counts only its own steps."""
    engine = make_engine(model, "paged", 512, 16, 128, attention_backend="torch")
    timer = _Timer()
    step = engine.step

    def timed_step(*a, **kw):
        timer.now += 1.0
        return step(*a, **kw)

    engine.step = timed_step
    trace = [TraceRequest("late", 100.0, 5, 3), TraceRequest("early", 0.0, 4, 2)]
    arrivals = [Arrival(r.arrival_time, r.request_id, list(range(3, 3 + r.prompt_len)), greedy(r.output_len))
                for r in trace]
    served = replay(engine, arrivals, Clock(timer, steps_only=True))
    df = requests_frame(trace, served).set_index("request_id")
    assert list(df.index) == ["early", "late"]  # by arrival
    assert df.loc["early", "finish_time"] == 2.0 and df.loc["early", "first_token_time"] == 1.0  # prefill, decode
    assert df.loc["late", "finish_time"] == 103.0  # jumped to 100, then 3 steps
    assert [len(t) for t in df.tokens] == [2, 3] and served.duration == 103.0
    assert len(served.running) == 5


def test_clock_counts_all_time_or_only_steps():
    timer = _Timer()
    all_time, steps = Clock(timer), Clock(timer, steps_only=True)
    timer.now = 2.0
    assert (all_time(), steps()) == (2.0, 0.0)
    all_time.advance_to(10.0)
    steps.advance_to(10.0)
    assert (all_time(), steps()) == (10.0, 10.0)
    all_time.advance_to(5.0)  # never backwards
    assert all_time() == 10.0


def test_fastest_keeps_each_functions_minimum_and_stops_on_budget():
    timer = _Timer()
    costs = {"a": iter([9, 3, 5, 4]), "b": iter([1, 2, 7, 0.5])}  # warm-up first, then the timed rounds

    def run(k):
        timer.now += next(costs[k])

    best, n = fastest({"a": lambda: run("a"), "b": lambda: run("b")}, 3, timer)
    assert (best, n) == ({"a": 3, "b": 0.5}, 3)
    calls = []
    best, n = fastest({"x": lambda: calls.append(1)}, 50, timer, min_reps=2, budget_s=0.0)
    assert n == 2 and len(calls) == 3  # warm-up + two rounds
    order = []
    fastest({k: (lambda k=k: order.append(k)) for k in "pqr"}, 4, timer, order_seed=1)
    rounds = [order[i:i + 3] for i in range(3, 15, 3)]
    assert all(sorted(r) == ["p", "q", "r"] for r in rounds) and len({tuple(r) for r in rounds}) > 1
