"""The simulator's step-time model (``sim.CostModel``): tensor parallelism (Megatron-LM style, §6.1) splits the bytes
and FLOPs over the GPUs and adds one all-reduce per layer; one GPU has no all-reduce term at all."""
from dataclasses import replace

import pytest

from pagedattn.repro.sim.simulator import CostModel


def test_one_gpu_has_no_allreduce_and_ignores_its_constants():
    base = CostModel()
    other = replace(base, allreduce_bytes_per_s=1.0, allreduce_latency_s=1.0, hidden_size=1)
    assert base.allreduce_time(4096) == 0.0
    for cm in (base, other):
        assert cm.decode_time(30, 9000) == base.decode_time(30, 9000)
        assert cm.prefill_time(2048) == base.prefill_time(2048)


def test_tensor_parallel_splits_bytes_and_adds_one_allreduce_per_layer():
    one = CostModel(step_overhead_s=0.0, step_overhead_per_seq_s=0.0)
    free = replace(one, tp_size=4, allreduce_latency_s=0.0, allreduce_bytes_per_s=float("inf"))
    assert free.decode_time(8, 4000) == pytest.approx(one.decode_time(8, 4000) / 4)  # memory-bound: 1/4 the bytes
    assert free.prefill_time(4096) == pytest.approx(one.prefill_time(4096) / 4)  # compute-bound: 1/4 the FLOPs
    tp = replace(free, allreduce_latency_s=1e-5, allreduce_bytes_per_s=1e11)
    ring = 2 * 3 / 4 * 8 * tp.hidden_size * 2 / 1e11  # ring all-reduce of 8 tokens' activations over 4 GPUs
    assert tp.allreduce_time(8) == pytest.approx(tp.num_layers * (1e-5 + ring))
    assert tp.decode_time(8, 4000) == pytest.approx(free.decode_time(8, 4000) + tp.allreduce_time(8))
