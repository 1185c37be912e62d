"""Attention through the paged KV cache (paper §4.1, Fig. 5-6).

Every layer owns a K and a V cache tensor of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``; a
sequence's token ``t`` lives in physical block ``block_table[t // block_size]`` at offset ``t % block_size`` (§4.2).
A forward pass takes a *flat* batch of ``T`` new tokens from several sequences and an ``AttentionMetadata`` that is
shared by all layers. Each layer

1. writes the new tokens' K/V into their slots (``reshape_and_cache``, the KV-cache write of §4.1; on a GPU a Llama
   layer has done so already, in the launch that applies RoPE: :meth:`PagedAttention.rope_and_cache`);
2. attends: a *prefill* (many query tokens per sequence, §4.3) runs, on a GPU, one SDPA call for all the step's
   sequences (:class:`PrefillLayout`), on a CPU one per sequence (``BATCHED_PREFILL``); a *decode* (one query token
   per sequence) runs the backend's ``paged_attention`` kernel over the block tables.

The batched prefill pads the step's sequences to the longest query (``L``). When every context is new (the usual
prefill) it runs causal SDPA over the right-padded fresh K/V: a padded key sits after every real one, so the causal
mask already hides it, and grouped-query attention goes through SDPA's ``enable_gqa``. When some sequence has a cached
context (a recomputed prompt, a shared prefix) it attends over the contexts read back from the cache by block table,
padded to the longest (``C``), with a mask that is causal with each sequence's offset; grouped-query attention then
packs the ``G`` query heads of a kv head as ``G * L`` rows against that kv head's keys (FlashInfer's GQA "query
packing"). Either way K/V are never repeated per query head in our code. No Python loop runs over sequences: the
layout's index tensors are built once per forward pass and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedattn.kernels import KernelBackend
from pagedattn.model import fused_ops


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
    prefill_layout: "PrefillLayout | None" = None  # built by the first layer of a prefill, shared by the others

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_list)


#: The prefill's path: None chooses by device, one SDPA call for the whole step (``_prefill_batched``) off the CPU,
#: where a Python loop of kernel launches over sequences keeps the GPU idle (issue 54), and one SDPA call per sequence
#: on the CPU, where the loop costs little and the padding of the batched call costs more (measured on the 2-core VM,
#: one thread: SDPA over 32 prompts of 16-200 tokens, 8 heads over 2, 21 ms per sequence vs 45 ms batched; the whole
#: prefill of those prompts on a 4-layer Llama of hidden 256, 345 ms batched vs 306 ms per sequence, order alternated).
#: True / False force a path (tests).
BATCHED_PREFILL: bool | None = None


class PagedAttention(torch.nn.Module):
    """Multi-head attention over paged K/V (GQA when ``num_kv_heads < num_heads``). Holds no weights."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # set by the executor (``ModelRunner._bind_caches``); empty until then
        self.backend: KernelBackend | None = None
        self.k_cache: Tensor = torch.empty(0)
        self.v_cache: Tensor = torch.empty(0)

    def rope_and_cache(self, query_key: Tensor, value: Tensor, cos: Tensor, sin_rot: Tensor,
                       meta: AttentionMetadata) -> bool:
        """On a GPU whose backend fuses them (Triton): RoPE on ``query_key`` ``[T, num_heads + num_kv_heads,
        head_dim]`` in place and the new K/V into their slots, in one launch; ``forward(..., kv_cached=True)`` then
        writes nothing. Returns False, having done nothing, elsewhere (the CPU keeps its own RoPE and write)."""
        ops = self.backend
        if ops is None or ops.rope_and_cache is None or not fused_ops.on_gpu(query_key):
            return False
        assert self.k_cache.numel(), "the caches are not bound (ModelRunner binds them)"
        ops.rope_and_cache(query_key, value.view(-1, self.num_kv_heads, self.head_dim), cos, sin_rot, self.k_cache,
                           self.v_cache, meta.slot_mapping)
        return True

    def forward(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata, kv_cached: bool = False) -> Tensor:
        """``q``: ``[T, num_heads * head_dim]``; ``k``, ``v``: ``[T, num_kv_heads * head_dim]`` -> ``[T, H * D]``.
        ``kv_cached``: ``k`` and ``v`` are in the cache already (:meth:`rope_and_cache`)."""
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        ops = self.backend
        assert ops is not None and self.k_cache.numel(), "the caches are not bound (ModelRunner binds them)"
        if not kv_cached:
            ops.reshape_and_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.is_prefill:
            out = self._prefill(q, k, v, meta)
        else:
            kw = {} if meta.decode_plan is None else {"plan": meta.decode_plan}
            out = ops.paged_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens, self.scale,
                                      **kw)
        return out.reshape(T, self.num_heads * self.head_dim)

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        batched = BATCHED_PREFILL if BATCHED_PREFILL is not None else q.device.type != "cpu"
        return (self._prefill_batched if batched else self._prefill_per_sequence)(q, k, v, meta)

    def _prefill_per_sequence(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        """Causal SDPA per sequence: over the fresh K/V when the whole context is new, else over the context gathered
        from the cache by block table, causal with an offset. The CPU's path (see ``BATCHED_PREFILL``)."""
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

    def _prefill_batched(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        """Causal attention of every sequence's new tokens over its whole context, in one SDPA call (see the module
        docstring). The GPU's path."""
        group = self.num_heads // self.num_kv_heads
        lay = meta.prefill_layout
        if lay is None or lay.group != group or lay.block_size != self.k_cache.shape[1]:
            lay = meta.prefill_layout = PrefillLayout.build(meta, self.k_cache.shape[1], group, q.device)
        S, L, H, KVH, D = lay.num_seqs, lay.max_query, self.num_heads, self.num_kv_heads, self.head_dim
        qp = q.new_zeros(S * L, H, D)
        qp[lay.q_rows] = q
        if lay.all_new:  # no cached context: right-padded fresh K/V, plain causal (a padded key follows every real one)
            kp, vp = q.new_zeros(S * L, KVH, D), q.new_zeros(S * L, KVH, D)
            kp[lay.q_rows], vp[lay.q_rows] = k, v
            qs, ks, vs = (t.view(S, L, -1, D).transpose(1, 2) for t in (qp, kp, vp))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=group > 1)
            return o.transpose(1, 2).reshape(S * L, H, D)[lay.q_rows]
        # [S, L, KVH, G, D] -> [S, KVH, G * L, D]: the G query heads of a kv head as rows against its keys
        qp = qp.view(S, L, KVH, group, D).permute(0, 2, 3, 1, 4).reshape(S, KVH, group * L, D)
        ks = self.k_cache.flatten(0, 1)[lay.kv_slots].permute(0, 2, 1, 3).to(q.dtype)  # [S, KVH, C, D]
        vs = self.v_cache.flatten(0, 1)[lay.kv_slots].permute(0, 2, 1, 3).to(q.dtype)
        o = F.scaled_dot_product_attention(qp, ks, vs, attn_mask=lay.mask, scale=self.scale)
        o = o.view(S, KVH, group, L, D).permute(0, 3, 1, 2, 4).reshape(S * L, H, D)
        return o[lay.q_rows]


@dataclass
class PrefillLayout:
    """Index tensors of a batched prefill (one per forward pass): ``S`` sequences padded to ``L`` query rows and ``C``
    context positions.

    - ``q_rows[i]``: the padded row (``s * L + j``) of flat token ``i``, the ``j``-th new token of sequence ``s``;
    - ``kv_slots[s, c]``: the cache slot of position ``c`` of sequence ``s`` (``block_tables[s, c // block_size] *
      block_size + c % block_size``; positions past the context point at a valid slot and are masked);
    - ``mask[s, 0, g * L + j, c]``: row ``j`` (query position ``context_len - new + j``) sees position ``c`` iff
      ``c <=`` that position, repeated over the ``group`` query heads of a kv head. A padded row sees the
      sequence's positions up to its last token, so no row is empty (no NaN); its output is dropped.
    """

    num_seqs: int
    max_query: int
    max_context: int
    group: int
    block_size: int
    q_rows: Tensor
    kv_slots: Tensor | None  # None (and no mask) when every context is new: ``all_new``
    mask: Tensor | None

    @property
    def all_new(self) -> bool:
        return self.kv_slots is None

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int, group: int, device: torch.device) -> "PrefillLayout":
        loc = torch.tensor(meta.query_start_loc, device=device)
        ctx = torch.tensor(meta.context_lens_list, device=device)
        new = loc[1:] - loc[:-1]
        starts = meta.query_start_loc
        S, C = len(meta.context_lens_list), max(meta.context_lens_list)
        L = max(b - a for a, b in zip(starts, starts[1:]))
        seq = torch.repeat_interleave(torch.arange(S, device=device), new)
        q_rows = seq * L + torch.arange(int(loc[-1]), device=device) - loc[:-1][seq]
        if all(c == b - a for c, a, b in zip(meta.context_lens_list, starts, starts[1:])):
            return cls(S, L, C, group, block_size, q_rows, None, None)
        pos = torch.arange(C, device=device)
        tables = meta.block_tables.long()
        kv_slots = tables[:, pos // block_size] * block_size + pos % block_size  # [S, C]
        q_pos = torch.minimum(ctx[:, None] - new[:, None] + torch.arange(L, device=device), ctx[:, None] - 1)
        mask = pos[None, None, :] <= q_pos[:, :, None]  # [S, L, C]
        mask = mask[:, None].expand(S, group, L, C).reshape(S, 1, group * L, C)
        return cls(S, L, C, group, block_size, q_rows, kv_slots, mask)
