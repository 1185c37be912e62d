"""Triton kernels for a decoder layer's small operations on a GPU: RMSNorm with the residual add, and RoPE over the
query and key heads, each one launch (issue 54: a decode step of a small batch is bound by launches, not bytes).

They follow vLLM's ``fused_add_rms_norm`` and ``rotary_embedding`` custom ops in what they fuse (read for
understanding, not copied), and round as transformers does, so that the result matches its torch lines:

- :func:`rms_norm`: ``h = x + residual`` rounded to the model dtype (written back into ``residual``), then
  ``weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)`` with the normalisation in fp32;
- :func:`rope`: ``x * cos + roll(x, D/2) * sin_rot`` (see :func:`pagedattn.model.llama.apply_rope`), each product
  rounded to the dtype before the sum, in place;
- :func:`rope_and_cache`: the same RoPE on the query and key heads, and the KV-cache write (§4.1) of the roped keys
  and the values through the slot mapping, in one launch instead of :func:`rope` plus ``reshape_and_cache``. vLLM
  runs these as two custom ops (``rotary_embedding``, then ``reshape_and_cache_flash`` in the attention layer);
  FlashInfer fuses them (``rope_quantize_fp8_append_paged_kv_cache``; ``cake_fused_qk_rmsnorm_rope_append_paged_kv_
  cache`` over a packed Q|K|V), as this kernel does over our fused qkv output. Both RoPE launches share one
  arithmetic (``_rope_tile``), so they agree bit for bit.

One program per token (row); the whole row is one tile (hidden sizes up to 16K, heads x head dim up to 16K).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pagedattn.kernels.paged_attention import INTERPRET, Launch  # noqa: F401  (INTERPRET: decided there, once)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["rms_norm", "rope", "rope_and_cache", "plan_rms_norm", "plan_rope", "plan_rope_and_cache"]


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
def _rope_tile(row, offs_d, c, s, mask, D: tl.constexpr):
    """RoPE of the heads at ``row`` (``[BLOCK_H, 1]`` pointers to their rows): ``x * cos + roll(x, D/2) * sin_rot``,
    each product rounded to the dtype before the sum. The one place of the arithmetic, for both RoPE launches; they
    are compiled without FMA contraction (``fp_fusion=False``), which in fp32 would round ``x * cos`` into the sum."""
    x = tl.load(row + offs_d[None, :], mask=mask, other=0.0)
    rolled = tl.load(row + ((offs_d + D // 2) % D)[None, :], mask=mask, other=0.0)  # roll by half: cat(x2, x1)
    dt = x.dtype
    a = (x.to(tl.float32) * c.to(tl.float32)).to(dt)
    b = (rolled.to(tl.float32) * s.to(tl.float32)).to(dt)
    return (a.to(tl.float32) + b.to(tl.float32)).to(dt)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ct, stride_st,
                 HEADS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    mask = (offs_h < HEADS)[:, None] & d_mask[None, :]
    row = x_ptr + tok * stride_xt + offs_h[:, None] * stride_xh
    c = tl.load(cos_ptr + tok * stride_ct + offs_d, mask=d_mask, other=0.0)[None, :]
    s = tl.load(sin_ptr + tok * stride_st + offs_d, mask=d_mask, other=0.0)[None, :]
    tl.store(row + offs_d[None, :], _rope_tile(row, offs_d, c, s, mask, D), mask=mask)


def plan_rope(x: Tensor, cos: Tensor, sin_rot: Tensor) -> Launch:
    """The launch of :func:`rope`: one program per token over all its heads."""
    tokens, heads, d = x.shape
    if d % 2 or x.stride(2) != 1 or cos.stride(2) != 1 or sin_rot.stride(2) != 1:
        raise ValueError(f"rope needs an even head dim with unit stride, got {d} (strides {x.stride(2)}, "
                         f"{cos.stride(2)}, {sin_rot.stride(2)})")
    return Launch(_rope_kernel, (tokens,), (x, cos, sin_rot, x.stride(0), x.stride(1), cos.stride(0),
                                            sin_rot.stride(0)),
                  dict(HEADS=heads, D=d, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(d)),
                  num_warps=4, num_stages=1, fp_fusion=False)


def rope(x: Tensor, cos: Tensor, sin_rot: Tensor) -> Tensor:
    """RoPE on ``x`` ``[T, heads, head_dim]`` in place (``cos``, ``sin_rot``: ``[T, 1, head_dim]``); returns ``x``."""
    if x.shape[0]:
        plan_rope(x, cos, sin_rot)()
    return x


@triton.jit
def _rope_and_cache_kernel(qk_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr,
                           stride_qkt, stride_qkh, stride_vt, stride_vh, stride_ct, stride_st,
                           stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                           HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One program per token: RoPE on its query and key heads in place (one tile, :func:`_rope_tile`), then its
    roped key heads and its value heads into slot ``slot_mapping[token]`` of the caches; a negative slot (padding)
    writes no cache, as in :func:`~pagedattn.kernels.paged_attention.reshape_and_cache`."""
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    mask = (offs_h < HEADS + KV_HEADS)[:, None] & d_mask[None, :]
    row = qk_ptr + tok * stride_qkt + offs_h[:, None] * stride_qkh
    c = tl.load(cos_ptr + tok * stride_ct + offs_d, mask=d_mask, other=0.0)[None, :]
    s = tl.load(sin_ptr + tok * stride_st + offs_d, mask=d_mask, other=0.0)[None, :]
    y = _rope_tile(row, offs_d, c, s, mask, D)
    tl.store(row + offs_d[None, :], y, mask=mask)  # q and k roped in place: the attention reads them next
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    # the key heads are rows HEADS .. HEADS + KV_HEADS - 1 of the roped tile
    k_mask = mask & (offs_h >= HEADS)[:, None] & ((tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot) >= 0)
    kc = kc_ptr + block * stride_kcb + offset * stride_kct + (offs_h - HEADS)[:, None] * stride_kch + offs_d[None, :]
    tl.store(kc, y.to(kc_ptr.dtype.element_ty), mask=k_mask)
    offs_v = tl.arange(0, BLOCK_KV)
    v_mask = ((offs_v < KV_HEADS)[:, None] & d_mask[None, :]
              & ((tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.int64) + slot) >= 0))
    v = tl.load(v_ptr + tok * stride_vt + offs_v[:, None] * stride_vh + offs_d[None, :], mask=v_mask)
    vc = vc_ptr + block * stride_vcb + offset * stride_vct + offs_v[:, None] * stride_vch + offs_d[None, :]
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=v_mask)


def plan_rope_and_cache(query_key: Tensor, value: Tensor, cos: Tensor, sin_rot: Tensor, key_cache: Tensor,
                        value_cache: Tensor, slot_mapping: Tensor) -> Launch:
    """The launch of :func:`rope_and_cache`: one program per token over all its query, key and value heads."""
    tokens, heads_qk, d = query_key.shape
    kv_heads = value.shape[1]
    block_size = key_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} must be a power of two")
    if d % 2 or any(t.stride(-1) != 1 for t in (query_key, value, cos, sin_rot, key_cache, value_cache)):
        raise ValueError(f"rope_and_cache needs an even head dim ({d}) with unit stride in every tensor")
    block_h = triton.next_power_of_2(heads_qk)
    return Launch(_rope_and_cache_kernel, (tokens,),
                  (query_key, value, cos, sin_rot, key_cache, value_cache, slot_mapping,
                   query_key.stride(0), query_key.stride(1), value.stride(0), value.stride(1), cos.stride(0),
                   sin_rot.stride(0), *key_cache.stride()[:3], *value_cache.stride()[:3]),
                  dict(HEADS=heads_qk - kv_heads, KV_HEADS=kv_heads, D=d, BLOCK_H=block_h,
                       BLOCK_KV=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(d),
                       BLOCK_SIZE=block_size),
                  num_warps=4, num_stages=1, fp_fusion=False)


def rope_and_cache(query_key: Tensor, value: Tensor, cos: Tensor, sin_rot: Tensor, key_cache: Tensor,
                   value_cache: Tensor, slot_mapping: Tensor) -> None:
    """RoPE on ``query_key`` ``[T, heads + kv_heads, head_dim]`` in place (the query heads, then the key heads), and
    the roped key heads and ``value`` ``[T, kv_heads, head_dim]`` written into slot ``slot_mapping[t]`` of
    ``key_cache`` / ``value_cache`` ``[num_blocks, block_size, kv_heads, head_dim]`` (a negative slot writes nothing):
    :func:`rope` followed by ``reshape_and_cache``, in one launch, for a decode or a prefill batch alike."""
    if query_key.shape[0]:
        plan_rope_and_cache(query_key, value, cos, sin_rot, key_cache, value_cache, slot_mapping)()
