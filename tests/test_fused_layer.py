"""The Triton RMSNorm (with the residual add) and RoPE kernels of a decoder layer on a GPU
(:mod:`pagedattn.kernels.fused_layer`), against transformers' torch lines (``pagedattn.model.fused_ops``), in
Triton's interpreter on the CPU: NaN-poisoned outputs, a non-power-of-two width, strided views as the model passes
them."""
from __future__ import annotations

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
