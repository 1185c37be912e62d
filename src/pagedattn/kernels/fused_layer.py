"""Triton kernels for a decoder layer's small operations on a GPU: RMSNorm with the residual add, and RoPE over the
query and key heads, each one launch (issue 54: a decode step of a small batch is bound by launches, not bytes).

They follow vLLM's ``fused_add_rms_norm`` and ``rotary_embedding`` custom ops in what they fuse (read for
understanding, not copied), and round as transformers does, so that the result matches its torch lines:

- :func:`rms_norm`: ``h = x + residual`` rounded to the model dtype (written back into ``residual``), then
  ``weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)`` with the normalisation in fp32;
- :func:`rope`: ``x * cos + roll(x, D/2) * sin_rot`` (see :func:`pagedattn.model.llama.apply_rope`), each product
  rounded to the dtype before the sum, in place.

One program per token (row); the whole row is one tile (hidden sizes up to 16K, heads x head dim up to 16K).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pagedattn.kernels.paged_attention import INTERPRET, Launch  # noqa: F401  (INTERPRET: decided there, once)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["rms_norm", "rope", "plan_rms_norm", "plan_rope"]


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        h = h.to(x_ptr.dtype.element_ty)  # the residual stream is kept in the model dtype, as in transformers
        tl.store(res_ptr + row * stride_r + offs, h, mask=mask)
        x = h
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = (xf * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def plan_rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor, residual: Optional[Tensor] = None) -> Launch:
    """The launch of :func:`rms_norm` (works on ``meta`` tensors, for the compile checks)."""
    rows, n = x.shape
    block = triton.next_power_of_2(n)
    res = residual if residual is not None else x
    return Launch(_rms_norm_kernel, (rows,), (x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), eps),
                  dict(N=n, BLOCK=block, HAS_RESIDUAL=residual is not None),
                  num_warps=min(max(block // 256, 1), 16), num_stages=1)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Optional[Tensor] = None) -> Tensor:
    """``norm(x + residual)`` (``residual`` updated in place to ``x + residual``) or ``norm(x)``, over the last
    dimension of a 2-D ``x`` whose rows are contiguous."""
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs rows with unit stride")
    out = torch.empty_like(x)
    if x.shape[0]:
        plan_rms_norm(x, weight, eps, out, residual)()
    return out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ct, stride_st,
                 HEADS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    mask = (offs_h < HEADS)[:, None] & d_mask[None, :]
    row = x_ptr + tok * stride_xt + offs_h[:, None] * stride_xh
    x = tl.load(row + offs_d[None, :], mask=mask, other=0.0)
    rolled = tl.load(row + ((offs_d + D // 2) % D)[None, :], mask=mask, other=0.0)  # roll by half: cat(x2, x1)
    c = tl.load(cos_ptr + tok * stride_ct + offs_d, mask=d_mask, other=0.0)[None, :]
    s = tl.load(sin_ptr + tok * stride_st + offs_d, mask=d_mask, other=0.0)[None, :]
    dt = x_ptr.dtype.element_ty
    a = (x.to(tl.float32) * c.to(tl.float32)).to(dt)
    b = (rolled.to(tl.float32) * s.to(tl.float32)).to(dt)
    tl.store(row + offs_d[None, :], (a.to(tl.float32) + b.to(tl.float32)).to(dt), mask=mask)


def plan_rope(x: Tensor, cos: Tensor, sin_rot: Tensor) -> Launch:
    """The launch of :func:`rope`: one program per token over all its heads."""
    tokens, heads, d = x.shape
    if d % 2 or x.stride(2) != 1 or cos.stride(2) != 1 or sin_rot.stride(2) != 1:
        raise ValueError(f"rope needs an even head dim with unit stride, got {d} (strides {x.stride(2)}, "
                         f"{cos.stride(2)}, {sin_rot.stride(2)})")
    return Launch(_rope_kernel, (tokens,), (x, cos, sin_rot, x.stride(0), x.stride(1), cos.stride(0),
                                            sin_rot.stride(0)),
                  dict(HEADS=heads, D=d, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(d)),
                  num_warps=4, num_stages=1)


def rope(x: Tensor, cos: Tensor, sin_rot: Tensor) -> Tensor:
    """RoPE on ``x`` ``[T, heads, head_dim]`` in place (``cos``, ``sin_rot``: ``[T, 1, head_dim]``); returns ``x``."""
    if x.shape[0]:
        plan_rope(x, cos, sin_rot)()
    return x
