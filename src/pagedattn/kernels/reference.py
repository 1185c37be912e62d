"""Torch reference implementations of the paged KV-cache kernels (§4.1, §5.1 of Kwon et al., SOSP 2023).

These are the CPU engine's decode path and the oracle the Triton kernels are tested against, so they are written
to be both exact and reasonably fast: no Python loop over tokens or blocks, only gathers by block table.

Cache layout (the same for every backend): ``key_cache`` / ``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence's logical block ``i`` lives in physical block
``block_tables[seq, i]``; its token ``t`` sits at ``(block_tables[seq, t // block_size], t % block_size)``
(§4.2, the block table). A *slot* is the flat index ``block_id * block_size + offset``.
"""
from __future__ import annotations

import math
import threading
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["paged_attention_ref", "reshape_and_cache_ref", "copy_blocks_ref", "swap_blocks_ref",
           "as_block_mapping", "release_workspace"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16/fp32 inputs are computed in fp32; fp64 inputs (the test oracle) stay in fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_WORKSPACE = threading.local()


def _gather_blocks(cache: Tensor, ids: Tensor, slot: int) -> Tensor:
    """``cache.index_select(0, ids)``; on the CPU into a reused, grow-only buffer (one per ``slot`` and thread).

    A fresh multi-megabyte tensor on every decode step costs page faults on each first touch (measured: a 64 MB
    gather takes 69 ms fresh vs 21 ms into a reused buffer on a 2-core VM). The returned view is only valid until
    the next call with the same ``slot`` on the same thread; :func:`paged_attention_ref` never lets it escape.
    """
    if cache.device.type != "cpu":
        return cache.index_select(0, ids)
    shape = (ids.numel(), *cache.shape[1:])
    numel = math.prod(shape)
    bufs = getattr(_WORKSPACE, "bufs", None)
    if bufs is None:
        bufs = _WORKSPACE.bufs = {}
    # a buffer made under inference_mode is an inference tensor: it may not be written outside that mode, so keep
    # one per mode (the engine decodes under inference_mode, tests and benchmarks may not)
    key = (slot, cache.dtype, torch.is_inference_mode_enabled())
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        buf = bufs[key] = torch.empty(numel, dtype=cache.dtype)
    out = buf[:numel].view(shape)
    torch.index_select(cache, 0, ids, out=out)
    return out


def release_workspace() -> None:
    """Free the CPU gather buffers of :func:`paged_attention_ref` (this thread's)."""
    _WORKSPACE.bufs = {}


def paged_attention_ref(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                        context_lens: Tensor, scale: float) -> Tensor:
    """Single-token (decode) attention of each sequence's query over its paged K/V cache (§4.1, Fig. 5).

    Args:
        query: ``[num_seqs, num_heads, head_dim]``, the new token of every sequence.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: int ``[num_seqs, max_blocks]``; entries past a sequence's last block are ignored (may be any
            value, e.g. -1 or 0). Cache slots past a sequence's context are never used, whatever they hold.
        context_lens: int ``[num_seqs]``, tokens already in the cache for each sequence (including the new one).
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns ``[num_seqs, num_heads, head_dim]`` in ``query.dtype``. GQA/MQA: ``num_heads`` must be a multiple of
    ``num_kv_heads``; query head ``h`` attends with kv head ``h // (num_heads // num_kv_heads)``. A sequence with
    ``context_len == 0`` gets zeros.

    The gather ``key_cache.index_select(0, block_tables)`` materialises each sequence's blocks in logical order (only
    up to the longest context), then one masked ``scaled_dot_product_attention`` (GQA through ``enable_gqa``) runs
    over all sequences at once, in fp32 (fp64 for fp64 inputs).
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    cdt = _compute_dtype(query.dtype)
    if num_seqs == 0:
        return torch.zeros_like(query)
    lens = context_lens.to(device=query.device, dtype=torch.long)
    max_len = int(lens.max().item())
    if max_len == 0:
        return torch.zeros_like(query)
    n_blocks = -(-max_len // block_size)
    ids = block_tables[:, :n_blocks].to(device=key_cache.device, dtype=torch.long).clamp(min=0).flatten()
    # gather each sequence's blocks in logical order, keep the first max_len tokens: [S, max_len, kvh, d]
    k = _gather_blocks(key_cache, ids, 0).view(num_seqs, n_blocks * block_size, num_kv_heads, head_dim)[:, :max_len]
    v = _gather_blocks(value_cache, ids, 1).view(num_seqs, n_blocks * block_size, num_kv_heads, head_dim)[:, :max_len]
    valid = torch.arange(max_len, device=query.device)[None, :] < lens.clamp(min=1)[:, None]
    # Slots past a sequence's context (the tail of its last block, or the rest of a longer sequence's span) may
    # hold anything, even NaN from an uninitialised cache, and 0 * NaN would poison the sum: zero them in the
    # gathered copy. Positions below the shortest context are valid for every sequence, so only [min, max) is touched.
    lo = int(lens.min().item())
    if lo < max_len:
        tail = ~valid[:, lo:, None, None]
        k[:, lo:].masked_fill_(tail, 0.0)
        v[:, lo:].masked_fill_(tail, 0.0)
    k, v = k.to(cdt).transpose(1, 2), v.to(cdt).transpose(1, 2)                 # [S, kvh, max_len, d]
    mask = valid[:, None, None, :] if lo < max_len else None  # equal lengths: no mask, SDPA's fastest path
    o = F.scaled_dot_product_attention(query.to(cdt)[:, :, None, :], k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=num_heads != num_kv_heads)[:, :, 0]
    o = o.masked_fill((lens == 0)[:, None, None], 0.0)  # an empty context attends to nothing
    return o.to(query.dtype)


def reshape_and_cache_ref(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                          slot_mapping: Tensor) -> None:
    """Write the new tokens' K/V into their cache slots, in place (§4.1: the KV-cache write of Fig. 6).

    ``key``/``value``: ``[num_tokens, num_kv_heads, head_dim]``; ``slot_mapping``: int ``[num_tokens]`` with
    ``slot = block_id * block_size + offset``; a negative slot marks a padding token and is skipped.
    """
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep.to(key.device)], value[keep.to(value.device)]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key.to(device=key_cache.device, dtype=key_cache.dtype)
    value_cache[blocks, offsets] = value.to(device=value_cache.device, dtype=value_cache.dtype)


def as_block_mapping(block_mapping, device: torch.device | str | None = None) -> Tensor:
    """Normalise a block mapping (``[n, 2]`` tensor, list of ``(src, dst)`` pairs, or ``{src: dst}`` /
    ``{src: [dst, ...]}`` dict) to an int64 ``[n, 2]`` tensor."""
    if isinstance(block_mapping, Tensor):
        return block_mapping.to(device=device, dtype=torch.long).reshape(-1, 2)
    if isinstance(block_mapping, dict):
        pairs = []
        for src, dst in block_mapping.items():
            for d in (dst if isinstance(dst, (list, tuple)) else [dst]):
                pairs.append((src, d))
        block_mapping = pairs
    return torch.tensor(list(block_mapping), dtype=torch.long, device=device).reshape(-1, 2)


def copy_blocks_ref(key_caches: Sequence[Tensor], value_caches: Sequence[Tensor], block_mapping) -> None:
    """Copy whole blocks ``src -> dst`` in every layer's K and V cache, in place (§4.4, copy-on-write).

    ``block_mapping``: int64 ``[n, 2]`` of ``(src, dst)`` physical block ids (or see :func:`as_block_mapping`).
    Destinations must be distinct and must not also be sources in the same call.
    """
    if not key_caches:
        return
    mapping = as_block_mapping(block_mapping, key_caches[0].device)
    if mapping.numel() == 0:
        return
    src, dst = mapping[:, 0], mapping[:, 1]
    for cache in list(key_caches) + list(value_caches):
        cache[dst] = cache[src]


def swap_blocks_ref(src_cache: Tensor, dst_cache: Tensor, block_mapping) -> None:
    """Copy blocks ``src -> dst`` between two caches of the same layout, e.g. GPU <-> CPU (§4.5, swapping).

    One call moves one cache tensor (call it for each layer's K and V). The gather happens on the source's device,
    then a single transfer, then a scatter on the destination's device.
    """
    mapping = as_block_mapping(block_mapping)
    if mapping.numel() == 0:
        return
    src = mapping[:, 0].to(src_cache.device)
    dst = mapping[:, 1].to(dst_cache.device)
    # non_blocking only host-to-device: a device-to-host copy must finish before the CPU scatter reads it
    moved = src_cache[src].to(device=dst_cache.device, dtype=dst_cache.dtype, non_blocking=dst_cache.is_cuda)
    dst_cache[dst] = moved
