"""The Triton RMSNorm (with the residual add), RoPE, and RoPE fused with the KV-cache write kernels of a decoder
layer on a GPU (:mod:`pagedattn.kernels.fused_layer`), against transformers' torch lines (``pagedattn.model.fused_ops``)
and the launches they replace, in Triton's interpreter on the CPU: NaN-poisoned outputs and caches, non-power-of-two
widths, strided views as the model passes them."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedattn import kernels

kernels.use_triton_interpreter()

from pagedattn.model import fused_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: the kernels round as the torch lines do; the fp32 normalisation's sum runs in another order
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
#: Triton's interpreter casts fp32 -> bf16 by truncation (a GPU rounds to nearest): one bf16 ulp apart there
INTERPRETED_BF16 = DEVICE == "cpu"


def same_rounding(a: torch.Tensor, b: torch.Tensor, magnitude: torch.Tensor | None = None) -> bool:
    """Bit-identical; for bf16 under the interpreter, within a truncation per rounding step (two steps, each one
    bf16 ulp of ``magnitude``, the size of the terms; default ``b``)."""
    if a.dtype == torch.bfloat16 and INTERPRETED_BF16:
        mag = (b if magnitude is None else magnitude).float().abs()
        return bool(((a.float() - b.float()).abs() <= 2 * mag * 2.0 ** -7).all())
    return torch.equal(a, b)


@pytest.fixture(scope="module")
def fused(triton):
    from pagedattn.kernels import fused_layer

    return fused_layer


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("hidden", [48, 64])
def test_rms_norm_with_and_without_residual(fused, dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)
    res = torch.randn(5, hidden, generator=g).to(DEVICE, dtype)
    assert (fused.rms_norm(x, w, 1e-6) - fused_ops.rms_norm_ref(x, w, 1e-6)).abs().max() <= TOL[dtype] * 4
    res_ref = res.clone()
    want = fused_ops.rms_norm_ref(x, w, 1e-6, residual=res_ref)
    got = fused.rms_norm(x, w, 1e-6, residual=res)
    assert same_rounding(res, res_ref)  # the residual add rounds as torch's
    assert torch.isfinite(got).all() and (got - want).abs().max() <= TOL[dtype] * 4


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("head_dim", [16, 24])
def test_rope_in_place_on_a_strided_view(fused, dtype, head_dim):
    """q and k heads are a view of the fused qkv output (rows longer than heads x head dim); v is left alone."""
    from pagedattn.model.llama import RotaryEmbedding
    from transformers import LlamaConfig

    g = torch.Generator().manual_seed(head_dim)
    T, heads, v_width = 3, 6, 2 * head_dim
    qkv = torch.randn(T, heads * head_dim + v_width, generator=g).to(DEVICE, dtype)
    cos, sin = RotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4), head_dim)(
        torch.tensor([0, 7, 130], device=DEVICE), dtype)
    view = qkv[:, :heads * head_dim].view(T, heads, head_dim)
    want = fused_ops.rope_ref(view, cos, sin)
    view_before = view.clone()
    v_before = qkv[:, heads * head_dim:].clone()
    out = fused.rope(view, cos, sin)
    assert out.data_ptr() == view.data_ptr()
    assert torch.equal(qkv[:, heads * head_dim:], v_before)
    rolled = view_before.roll(head_dim // 2, -1)
    terms = (view_before.float() * cos.float()).abs() + (rolled.float() * sin.float()).abs()
    assert same_rounding(out, want, terms)  # each product rounded to the dtype, then the sum: torch's elementwise order


def _rope_and_cache_case(dtype, heads, kv_heads, head_dim, block_size, seed):
    """A flat batch of 7 tokens of several sequences (positions, slots anywhere in the cache, two padding slots -1),
    as the model passes it: q|k heads and v are views of one fused qkv output; NaN-poisoned caches."""
    from pagedattn.model.llama import RotaryEmbedding
    from transformers import LlamaConfig

    g = torch.Generator().manual_seed(seed)
    T, num_blocks = 7, 5
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    positions = torch.randint(0, 4000, (T,), generator=g).to(DEVICE)
    cos, sin = RotaryEmbedding(LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads), head_dim)(
        positions, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[[1, 4]] = -1
    cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    return qkv, cos, sin, slots.to(DEVICE), cache


def _split(qkv, heads, kv_heads, head_dim):
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(-1, heads + kv_heads, head_dim)
    return qk, qkv[:, (heads + kv_heads) * head_dim:].view(-1, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("head_dim,block_size", [(64, 8), (128, 16), (80, 32)])
def test_rope_and_cache_equals_rope_then_cache_write(fused, dtype, heads, kv_heads, head_dim, block_size):
    """One launch = RoPE on q and k in place + the KV-cache write of the roped k and v: bit-identical to the two
    Triton launches it replaces in every dtype, and to the torch lines (``rope_ref`` + ``reshape_and_cache_ref``)
    in fp32 and fp16 (bf16: the interpreter's truncation, see ``same_rounding``); padding slots (-1) and every slot
    not in the mapping keep their NaN poison; v is read only."""
    from pagedattn.kernels import paged_attention as pa
    from pagedattn.kernels.reference import reshape_and_cache_ref

    qkv, cos, sin, slots, cache = _rope_and_cache_case(dtype, heads, kv_heads, head_dim, block_size,
                                                       seed=heads * head_dim + block_size)
    runs = {}
    for name in ("fused", "two_launches", "torch"):
        x, kc, vc = qkv.clone(), cache.clone(), cache.clone()
        qk, v = _split(x, heads, kv_heads, head_dim)
        if name == "fused":
            fused.rope_and_cache(qk, v, cos, sin, kc, vc, slots)
        elif name == "two_launches":
            fused.rope(qk, cos, sin)
            pa.reshape_and_cache(qk[:, heads:], v, kc, vc, slots)
        else:
            fused_ops.rope_and_cache_ref(qk, v, cos, sin, kc, vc, slots)
        runs[name] = (x, kc, vc)
    x, kc, vc = runs["fused"]
    assert torch.equal(x[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:])  # v untouched
    written = slots[slots >= 0].long()
    assert torch.isfinite(kc.flatten(0, 1)[written]).all() and torch.isfinite(vc.flatten(0, 1)[written]).all()
    assert int(kc.isfinite().all(-1).all(-1).sum()) == len(written)  # nothing else was written
    exact: dict[str, Any] = dict(rtol=0, atol=0, equal_nan=True)
    for name in ("two_launches", "torch"):
        if name == "torch" and dtype == torch.bfloat16 and INTERPRETED_BF16:
            break
        for got, want in zip(runs["fused"], runs[name]):
            torch.testing.assert_close(got, want, **exact, msg=lambda m: f"against {name}: {m}")
    if dtype == torch.bfloat16 and INTERPRETED_BF16:  # against torch: within the interpreter's bf16 truncation
        rx = runs["torch"][0]
        qk0, _ = _split(qkv, heads, kv_heads, head_dim)
        terms = (qk0.float() * cos.float()).abs() + (qk0.roll(head_dim // 2, -1).float() * sin.float()).abs()
        assert same_rounding(_split(x, heads, kv_heads, head_dim)[0], _split(rx, heads, kv_heads, head_dim)[0], terms)
        assert torch.equal(vc.isnan(), runs["torch"][2].isnan())
        torch.testing.assert_close(vc, runs["torch"][2], **exact)  # v is copied, not computed


def test_rope_and_cache_is_one_launch_and_refuses_odd_shapes(fused):
    m: dict[str, Any] = dict(device="meta", dtype=torch.float16)
    qk, v = torch.empty(4, 10, 64, **m), torch.empty(4, 2, 64, **m)
    cs, cache = torch.empty(4, 1, 64, **m), torch.empty(3, 16, 2, 64, **m)
    launch = fused.plan_rope_and_cache(qk, v, cs, cs, cache, cache, torch.empty(4, dtype=torch.long, device="meta"))
    assert launch.grid == (4,) and launch.constexprs["HEADS"] == 8 and launch.constexprs["KV_HEADS"] == 2
    with pytest.raises(ValueError, match="power of two"):
        fused.plan_rope_and_cache(qk, v, cs, cs, torch.empty(3, 12, 2, 64, **m), cache, torch.empty(4))
