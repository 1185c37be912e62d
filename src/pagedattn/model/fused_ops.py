"""Where a decoder layer's RMSNorm and RoPE run: on a GPU, one Triton launch each
(:mod:`pagedattn.kernels.fused_layer`); elsewhere the torch lines below (the CPU's C++ paths are chosen by the
callers first). RoPE fused with the KV-cache write is the Triton backend's ``rope_and_cache``
(``PagedAttention.rope_and_cache`` decides); :func:`rope_and_cache_ref` is its torch oracle.
``tests/test_op_budget.py`` counts the launches of a decode step through these names."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def on_gpu(x: Tensor) -> bool:
    return x.is_cuda


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float, residual: Optional[Tensor] = None) -> Tensor:
    """transformers' RMSNorm lines, with ``residual += x`` first when given (the torch path of :func:`rms_norm`)."""
    if residual is not None:
        residual.add_(x)
        x = residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_launch(x: Tensor, weight: Tensor, eps: float, residual: Optional[Tensor] = None) -> Tensor:
    from pagedattn.kernels import fused_layer

    return fused_layer.rms_norm(x, weight, eps, residual)


def rope_ref(x: Tensor, cos: Tensor, sin_rot: Tensor) -> Tensor:
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_rot


def rope_launch(x: Tensor, cos: Tensor, sin_rot: Tensor) -> Tensor:
    from pagedattn.kernels import fused_layer

    return fused_layer.rope(x, cos, sin_rot)


def rope_and_cache_ref(query_key: Tensor, value: Tensor, cos: Tensor, sin_rot: Tensor, key_cache: Tensor,
                       value_cache: Tensor, slot_mapping: Tensor) -> None:
    """:func:`rope_ref` on the query and key heads in place, then the torch KV-cache write of the key heads (the
    last ``value.shape[1]``) and ``value`` (the torch path of :func:`pagedattn.kernels.fused_layer.rope_and_cache`)."""
    from pagedattn.kernels.reference import reshape_and_cache_ref

    query_key.copy_(rope_ref(query_key, cos, sin_rot))
    reshape_and_cache_ref(query_key[:, query_key.shape[1] - value.shape[1]:], value, key_cache, value_cache,
                          slot_mapping)
