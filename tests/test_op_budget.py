"""Device operations per decode step per layer (issue 54): the torch profiler counts, on the CPU, the operations a
decode step issues on the path a GPU takes, and the test asserts a budget.

What counts: each torch call the model makes at the top level that is not a view or a metadata call (on a GPU each
launches a kernel), and each call of a kernel-backend operation (attention, KV-cache write, RoPE fused with the
KV-cache write) or of a fused layer operation (RMSNorm, RoPE), which is one Triton launch on a GPU (checked below on
their launch plans). The CPU's C++
fast paths are switched off so that the model takes the lines a GPU runs. The per-layer figure is the difference
between a 4-layer and a 2-layer model over 2, so the step's fixed work (embedding, RoPE tables, LM head) drops out.
"""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pagedattn import kernels
from pagedattn.kernels import reference
from pagedattn.model import fused_ops
from pagedattn.model.attention import AttentionMetadata, PagedAttention
from pagedattn.model.loader import load_model
from tiny_models import tiny_llama, tiny_opt

#: issue 54's budget of device operations per decode step per layer
BUDGET = 15
#: calls that launch nothing on a GPU (views, metadata, allocation)
NO_KERNEL = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::slice", "aten::select",
             "aten::transpose", "aten::permute", "aten::t", "aten::unsqueeze", "aten::squeeze", "aten::expand",
             "aten::detach", "aten::alias", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::narrow",
             "aten::split", "aten::chunk", "aten::unbind", "aten::lift_fresh", "aten::resolve_conj", "aten::flatten",
             "aten::contiguous", "aten::_unsafe_view", "aten::numel", "aten::size", "aten::stride", "aten::is_nonzero",
             "aten::result_type", "aten::view_as"}
FUSED = "pagedattn::"


def _counting(fn, name):
    def wrapped(*args, **kw):
        with record_function(FUSED + name):
            return fn(*args, **kw)
    return wrapped


def _model_and_step(make, layers: int, dtype: torch.dtype, batch: int = 4, context: int = 20, block_size: int = 16,
                    fuse_rope_and_cache: bool = True):
    """Our decoder over a tiny random model and the metadata of one decode step of ``batch`` sequences. The counting
    backend fuses RoPE with the cache write as the Triton backend does, unless ``fuse_rope_and_cache`` is False."""
    model = load_model(make(num_hidden_layers=layers), dtype=dtype)
    attn = [m for m in model.modules() if isinstance(m, PagedAttention)]
    a = attn[0]
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    ops = reference  # the torch kernels, each call counted as one launch
    backend = kernels.KernelBackend("count", _counting(ops.paged_attention_ref, "paged_attention"),
                                    _counting(ops.reshape_and_cache_ref, "reshape_and_cache"),
                                    ops.copy_blocks_ref, ops.swap_blocks_ref,
                                    rope_and_cache=_counting(fused_ops.rope_and_cache_ref, "rope_and_cache")
                                    if fuse_rope_and_cache else None)
    for layer in attn:
        layer.k_cache = torch.randn(num_blocks, block_size, a.num_kv_heads, a.head_dim).to(dtype)
        layer.v_cache = torch.randn_like(layer.k_cache)
        layer.backend = backend
    tables = torch.arange(num_blocks, dtype=torch.int32).view(batch, blocks_per_seq)
    slots = tables[:, (context - 1) // block_size].long() * block_size + (context - 1) % block_size
    meta = AttentionMetadata(False, slots, tables, torch.full((batch,), context, dtype=torch.int32), [],
                             [context] * batch)
    ids = torch.randint(0, model.config.vocab_size, (batch,))
    pos = torch.full((batch,), context - 1)
    return model, ids, pos, meta


def count_ops(make, layers: int, dtype: torch.dtype, fuse_rope_and_cache: bool = True) -> int:
    model, ids, pos, meta = _model_and_step(make, layers, dtype, fuse_rope_and_cache=fuse_rope_and_cache)
    with torch.inference_mode():
        model(ids, pos, meta)  # warm-up: fused weights, RoPE tables
        with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("decode_step"):
            model.compute_logits(model(ids, pos, meta))
    step = next(e for e in prof.events() if e.name == "decode_step")
    return sum(1 for e in step.cpu_children if e.name.startswith(FUSED) or e.name not in NO_KERNEL)


@pytest.fixture
def gpu_path(monkeypatch):
    """The model's GPU lines on the CPU: no C++ fast path, and the fused layer operations counted as one launch."""
    from pagedattn.kernels import cpu

    monkeypatch.setattr(cpu, "takes", lambda *xs, **kw: False)
    monkeypatch.setattr(fused_ops, "on_gpu", lambda x: True)
    for name in ("rms_norm", "rope"):
        monkeypatch.setattr(fused_ops, f"{name}_launch", _counting(getattr(fused_ops, f"{name}_ref"), name))


@pytest.mark.parametrize("make,dtype", [(tiny_llama, torch.bfloat16), (tiny_opt, torch.float16)],
                         ids=["llama-bf16", "opt-fp16"])
def test_decode_step_stays_within_the_op_budget_per_layer(gpu_path, make, dtype):
    two, four = count_ops(make, 2, dtype), count_ops(make, 4, dtype)
    per_layer = (four - two) / 2
    assert per_layer == int(per_layer)  # every layer issues the same operations
    assert per_layer <= BUDGET, f"{per_layer} device operations per layer per decode step (budget {BUDGET})"
    # the counter sees the layer: its projections, attention and MLP are at least 8 operations
    assert per_layer >= 8


def test_rope_fused_with_the_cache_write_saves_one_launch_per_llama_layer(gpu_path):
    """With a backend that fuses RoPE and the KV-cache write (Triton on a GPU), a Llama layer issues one operation
    fewer than with the two apart; OPT has no RoPE, and its cache write is one launch either way."""
    fused = count_ops(tiny_llama, 4, torch.bfloat16) - count_ops(tiny_llama, 2, torch.bfloat16)
    apart = (count_ops(tiny_llama, 4, torch.bfloat16, fuse_rope_and_cache=False)
             - count_ops(tiny_llama, 2, torch.bfloat16, fuse_rope_and_cache=False))
    assert (apart - fused) / 2 == 1
    opt = [count_ops(tiny_opt, 4, torch.float16, f) - count_ops(tiny_opt, 2, torch.float16, f) for f in (True, False)]
    assert opt[0] == opt[1]


def test_fused_operations_are_one_launch_each():
    """What the count above takes as one launch is one: the Triton plans of the fused operations."""
    from pagedattn.kernels import fused_layer
    from pagedattn.kernels import paged_attention as pa

    x = torch.empty(4, 64, device="meta", dtype=torch.bfloat16)
    w = torch.empty(64, device="meta", dtype=torch.bfloat16)
    assert isinstance(fused_layer.plan_rms_norm(x, w, 1e-6, out=x), pa.Launch)
    qk = torch.empty(4, 6, 16, device="meta", dtype=torch.bfloat16)
    cs = torch.empty(4, 1, 16, device="meta", dtype=torch.bfloat16)
    assert isinstance(fused_layer.plan_rope(qk, cs, cs), pa.Launch)
    cache = torch.empty(3, 16, 2, 16, device="meta", dtype=torch.bfloat16)
    slots = torch.empty(4, dtype=torch.long, device="meta")
    assert isinstance(fused_layer.plan_rope_and_cache(qk, qk[:, 4:], cs, cs, cache, cache, slots), pa.Launch)
    assert isinstance(pa.plan_reshape_and_cache(qk[:, 4:], qk[:, 4:], cache, cache, slots), pa.Launch)  # OPT's
