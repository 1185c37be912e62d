"""Attention through the paged KV cache (paper §4.1, Fig. 5-6).

Every layer owns a K and a V cache tensor of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``; a
sequence's token ``t`` lives in physical block ``block_table[t // block_size]`` at offset ``t % block_size`` (§4.2).
A forward pass takes a *flat* batch of ``T`` new tokens from several sequences and an ``AttentionMetadata`` that is
shared by all layers. Each layer

1. writes the new tokens' K/V into their slots (``reshape_and_cache``, the KV-cache write of §4.1);
2. attends: a *prefill* (many query tokens per sequence, §4.3) runs causal SDPA per sequence, over the fresh K/V
   when the whole context is new, or over the context gathered from the cache by block table when part of it was
   cached before (a recomputed or shared prefix); a *decode* (one query token per sequence) runs the backend's
   ``paged_attention`` kernel over the block tables.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedattn.kernels import KernelBackend


@dataclass
class AttentionMetadata:
    """What one forward pass needs to find every sequence's K/V (shared by all layers).

    ``slot_mapping[i]`` is the cache slot of flat token ``i``; ``block_tables`` is ``[S, max_blocks]`` (padded);
    ``context_lens[s]`` counts sequence ``s``'s tokens in the cache after this step's write (context + query).
    For a prefill, ``query_start_loc`` (``S + 1`` offsets into the flat batch) and ``context_lens_list`` are the same
    numbers as Python ints, for the per-sequence loop.
    """

    is_prefill: bool
    slot_mapping: Tensor
    block_tables: Tensor
    context_lens: Tensor
    query_start_loc: list[int]
    context_lens_list: list[int]
    decode_plan: object | None = None  # the backend's per-step decode layout (``KernelBackend.plan_decode``)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_list)


class PagedAttention(torch.nn.Module):
    """Multi-head attention over paged K/V (GQA when ``num_kv_heads < num_heads``). Holds no weights."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.backend: KernelBackend | None = None  # set by the executor (``ModelRunner._bind_caches``)
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        """``q``: ``[T, num_heads * head_dim]``; ``k``, ``v``: ``[T, num_kv_heads * head_dim]`` -> ``[T, H * D]``."""
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        ops = self.backend
        ops.reshape_and_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.is_prefill:
            out = self._prefill(q, k, v, meta)
        else:
            kw = {} if meta.decode_plan is None else {"plan": meta.decode_plan}
            out = ops.paged_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens, self.scale,
                                      **kw)
        return out.reshape(T, self.num_heads * self.head_dim)

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        out = torch.empty_like(q)
        loc, bs = meta.query_start_loc, self.k_cache.shape[1]
        gqa = self.num_heads // self.num_kv_heads
        for s in range(meta.num_seqs):
            start, end, ctx = loc[s], loc[s + 1], meta.context_lens_list[s]
            qs = q[start:end].transpose(0, 1)  # [H, L, D]
            n_new = end - start
            if ctx == n_new:  # the whole context is new: attend over the fresh K/V
                ks, vs, mask, causal = k[start:end], v[start:end], None, True
            else:  # cached context before the query: gather it by block table, causal with an offset
                table = meta.block_tables[s, : -(-ctx // bs)].long()
                ks = self.k_cache[table].flatten(0, 1)[:ctx]
                vs = self.v_cache[table].flatten(0, 1)[:ctx]
                rows = torch.arange(ctx - n_new, ctx, device=q.device)[:, None]
                mask, causal = rows >= torch.arange(ctx, device=q.device)[None, :], False
            ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)  # [KVH, C, D]
            if gqa > 1:
                ks, vs = ks.repeat_interleave(gqa, dim=0), vs.repeat_interleave(gqa, dim=0)
            # 4-D inputs: on the CPU, 3-D SDPA falls back to a much slower path
            o = F.scaled_dot_product_attention(qs[None], ks.to(qs.dtype)[None], vs.to(qs.dtype)[None],
                                               attn_mask=mask, is_causal=causal, scale=self.scale)
            out[start:end] = o[0].transpose(0, 1)
        return out
