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
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["paged_attention_ref", "plan_decode", "DecodePlan", "reshape_and_cache_ref", "copy_blocks_ref", "swap_blocks_ref",
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


@dataclass
class Bucket:
    """Sequences attended together: their first ``num_blocks`` blocks are gathered, ``length`` tokens attended."""

    rows: Tensor | None   # long [n], this bucket's rows of the batch (None: every row, in order)
    ids: Tensor           # long [n * num_blocks], physical block ids in logical order
    num_blocks: int
    length: int           # the longest context in the bucket
    valid: Tensor | None  # bool [n, length], True where a token is inside its context (None: all are)
    tail: Tensor | None   # long: flat positions in the gathered [n * num_blocks * block_size] tokens past a context
    masks: dict = field(default_factory=dict)  # additive SDPA masks by dtype, made once per step

    def mask(self, dtype: torch.dtype) -> Tensor | None:
        """Additive mask ``[n, 1, 1, length]`` (0 inside a context, -inf past it), cached: SDPA would otherwise
        convert a boolean mask in every layer."""
        if self.valid is None:
            return None
        m = self.masks.get(dtype)
        if m is None:
            m = self.masks[dtype] = torch.zeros(self.valid.shape, dtype=dtype, device=self.valid.device).masked_fill_(
                ~self.valid, float("-inf"))[:, None, None, :]
        return m


@dataclass
class DecodePlan:
    """A decode step's attention layout, built once per step and shared by every layer (§4.1, Fig. 5).

    Sequences are grouped into buckets by their number of blocks so that no sequence is padded to the batch's
    longest context: a bucket gathers only up to its own longest sequence. The buckets are chosen to minimise a
    cost of ``BUCKET_COST_BLOCKS`` blocks per bucket (fixed per-call overhead) plus one per gathered block.
    """

    buckets: list[Bucket]
    num_seqs: int
    has_empty: bool        # some sequence has context 0 (its output is zeros)


# Cost of one more bucket, in gathered blocks. Fitted on a 2-core Xeon VM (one thread, load average ~11; block 16,
# 4 KV heads x 32 dims, fp32): one bucket costs ~61 us of fixed torch calls plus ~3.3 us per gathered block.
BUCKET_COST_BLOCKS = 18


def _choose_buckets(counts: list[tuple[int, int]]) -> list[int]:
    """``counts``: ``(num_blocks, num_seqs)`` by decreasing ``num_blocks``. Returns the start index of each bucket
    (a run of consecutive entries padded to its first, largest, block count), minimising the plan's cost."""
    m = len(counts)
    best, start = [0.0] * (m + 1), [0] * (m + 1)
    for b in range(1, m + 1):
        best[b], n = math.inf, 0
        for a in range(b, 0, -1):   # bucket = entries a-1 .. b-1, padded to counts[a-1]
            n += counts[a - 1][1]
            c = best[a - 1] + BUCKET_COST_BLOCKS + n * counts[a - 1][0]
            if c < best[b]:
                best[b], start[b] = c, a - 1
    cuts, b = [], m
    while b > 0:
        cuts.append(start[b])
        b = start[b]
    return cuts[::-1]


def plan_decode(block_tables: Tensor, context_lens: Tensor, block_size: int,
                lens: list[int] | None = None) -> DecodePlan:
    """Group a decode batch into buckets of similar block counts (see :class:`DecodePlan`). ``lens`` are the
    context lengths as Python ints when the caller has them (else read from ``context_lens``, one host sync)."""
    lens = context_lens.tolist() if lens is None else lens
    rows_by_blocks: dict[int, list[int]] = {}
    for s, n in enumerate(lens):
        if n > 0:
            rows_by_blocks.setdefault(-(-n // block_size), []).append(s)
    counts = sorted(((nb, len(r)) for nb, r in rows_by_blocks.items()), reverse=True)
    cuts = _choose_buckets(counts) + [len(counts)]
    table = block_tables.to(torch.long)
    if (table < 0).any():  # entries past a sequence's last block may be -1: gather block 0 there, then zero it
        table = table.clamp(min=0)
    device = context_lens.device
    buckets = []
    for a, b in zip(cuts, cuts[1:]):
        num_blocks = counts[a][0]
        rows = [s for nb, _ in counts[a:b] for s in rows_by_blocks[nb]]
        if len(rows) == len(lens):  # one bucket of every sequence: keep the batch order, no row gather
            rows_t, sub, blens = None, table[:, :num_blocks], context_lens.to(torch.long)
        else:
            rows_t = torch.tensor(rows, dtype=torch.long, device=table.device)
            sub, blens = table.index_select(0, rows_t)[:, :num_blocks], torch.tensor([lens[s] for s in rows],
                                                                                  device=device)
        length = max(lens[s] for s in rows)
        valid = tail = None
        if min(lens[s] for s in rows) < length:
            valid = torch.arange(length, device=device)[None, :] < blens[:, None]
            r, t = (~valid).nonzero(as_tuple=True)
            tail = r * (num_blocks * block_size) + t
        buckets.append(Bucket(rows_t, sub.flatten(), num_blocks, length, valid, tail))
    return DecodePlan(buckets, len(lens), 0 in lens)


def paged_attention_ref(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                        context_lens: Tensor, scale: float, plan: DecodePlan | None = None) -> Tensor:
    """Single-token (decode) attention of each sequence's query over its paged K/V cache (§4.1, Fig. 5).

    Args:
        query: ``[num_seqs, num_heads, head_dim]``, the new token of every sequence.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: int ``[num_seqs, max_blocks]``; entries past a sequence's last block are ignored (may be any
            value, e.g. -1 or 0). Cache slots past a sequence's context are never used, whatever they hold.
        context_lens: int ``[num_seqs]``, tokens already in the cache for each sequence (including the new one).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        plan: :func:`plan_decode` of ``block_tables``/``context_lens``, when the caller (the engine, once per
            step) already built it; built here otherwise.

    Returns ``[num_seqs, num_heads, head_dim]`` in ``query.dtype``. GQA/MQA: ``num_heads`` must be a multiple of
    ``num_kv_heads``; query head ``h`` attends with kv head ``h // (num_heads // num_kv_heads)``. A sequence with
    ``context_len == 0`` gets zeros.

    Per bucket of the plan: ``key_cache.index_select(0, ids)`` gathers its sequences' blocks in logical order (up to
    the bucket's longest context), then one ``scaled_dot_product_attention`` runs over
    them, in fp32 (fp64 for fp64 inputs), masked only if the contexts differ; with GQA the query heads of one kv
    head are that head's query rows. NaN-safe: the gathered slots past a
    context (the bucket's ``tail``: at most the padding, never the whole tensor) are zeroed in the copy, so a
    masked-out slot can never poison the weighted sum with ``0 * NaN``.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    cdt = _compute_dtype(query.dtype)
    if plan is None:
        plan = plan_decode(block_tables, context_lens, block_size)
    if not plan.buckets:
        return torch.zeros_like(query)
    q, group = query.to(cdt), num_heads // num_kv_heads
    out = torch.zeros_like(q) if plan.has_empty else None
    for b in plan.buckets:
        qb = q if b.rows is None else q.index_select(0, b.rows)
        n, padded = qb.shape[0], b.num_blocks * block_size
        k = _gather_blocks(key_cache, b.ids, 0)
        v = _gather_blocks(value_cache, b.ids, 1)
        if b.tail is not None:
            k.view(-1, num_kv_heads, head_dim).index_fill_(0, b.tail, 0.0)
            v.view(-1, num_kv_heads, head_dim).index_fill_(0, b.tail, 0.0)
        k = k.view(n, padded, num_kv_heads, head_dim)[:, :b.length].to(cdt).transpose(1, 2)  # [n, kvh, len, d]
        v = v.view(n, padded, num_kv_heads, head_dim)[:, :b.length].to(cdt).transpose(1, 2)
        # GQA: a kv head's query heads are its "query rows" (query head h uses kv head h // group), so each K/V row
        # is read once for the whole group, not once per query head
        o = F.scaled_dot_product_attention(qb.view(n, num_kv_heads, group, head_dim), k, v, attn_mask=b.mask(cdt),
                                           scale=scale).reshape(n, num_heads, head_dim)
        if b.rows is None:  # the only bucket, every row in order
            out = o
        else:
            if out is None:
                out = torch.empty_like(q)
            out.index_copy_(0, b.rows, o)
    assert out is not None  # (every row belongs to a bucket)
    return out.to(query.dtype)


def reshape_and_cache_ref(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                          slot_mapping: Tensor) -> None:
    """Write the new tokens' K/V into their cache slots, in place (§4.1: the KV-cache write of Fig. 6).

    ``key``/``value``: ``[num_tokens, num_kv_heads, head_dim]``; ``slot_mapping``: int ``[num_tokens]`` with
    ``slot = block_id * block_size + offset``; a negative slot marks a padding token and is skipped.
    """
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.long)
    if slots.numel() and int(slots.min()) < 0:  # padding tokens: skip them
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep.to(key.device)], value[keep.to(value.device)]
    for src, cache in ((key, key_cache), (value, value_cache)):
        src = src.to(device=cache.device, dtype=cache.dtype)
        if cache.is_contiguous():  # one flat copy by slot: no block / offset split
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, src)
        else:
            cache[slots // cache.shape[1], slots % cache.shape[1]] = src


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
