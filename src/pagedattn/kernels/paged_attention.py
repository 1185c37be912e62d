"""Triton PagedAttention decode kernel (§4.1 and §5.1 of Kwon et al., SOSP 2023).

Each program handles one (sequence, kv head) pair -- all ``num_heads // num_kv_heads`` query heads that share the kv
head, so with GQA each K/V byte is read once per group -- and walks the sequence's context in *tiles* of
``TILE_N`` tokens. A tile is gathered through the block table token by token: logical block ``t // BLOCK_SIZE``,
physical block ``block_tables[seq, t // BLOCK_SIZE]``, offset ``t % BLOCK_SIZE``; with block size <= TILE_N a tile
covers several blocks, with larger blocks a tile is a slice of one block, so any power-of-two block size from 1 to
256 works. Scores and the output are accumulated in fp32 with the online (streaming) softmax, so the kernel never
materialises the whole context (§5.1: "fused block read and attention").

For long contexts with few sequences the grid above is too small to fill the GPU, so a *split-KV* path
(flash-decoding) also splits each context into partitions of ``partition_size`` tokens: each partition writes its
un-normalised output, running max and running sum, and a reduce kernel rescales and combines them. A heuristic
chooses the path; ``split_kv=True/False`` forces it.

All strides are passed explicitly (caches and queries may be views), and block ids are cast to int64 before they
are multiplied by a stride, so caches larger than 2**31 elements are addressed correctly.

Under ``TRITON_INTERPRET=1`` (CPU, tests) the kernels run in Triton's interpreter; there ``tl.dot`` on bf16 operands
is unreliable, so the dot operands are cast to fp32 (``DOT_FP32``). On a GPU, fp16/bf16 caches feed ``tl.dot`` in their
own dtype (fp32 accumulation) and fp32 caches use ``input_precision="ieee"`` (no TF32).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

if not torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET"):
    # compiled Triton needs a GPU; on a CPU only the interpreter can run these kernels, and triton.jit decides
    # which one when the kernels below are defined, so decide before that
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch import Tensor  # noqa: E402

from pagedattn.kernels.reference import as_block_mapping, swap_blocks_ref  # noqa: E402

__all__ = ["paged_attention", "reshape_and_cache", "copy_blocks", "swap_blocks", "use_split_kv", "INTERPRET"]

#: True when the kernels were defined under Triton's CPU interpreter (decided at import time by triton.jit).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

_LOG2E = 1.4426950408889634
_DEFAULT_PARTITION = 512


@triton.jit
def _paged_attn_kernel(
    out_ptr, tmp_out_ptr, tmp_m_ptr, tmp_l_ptr,
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel uses exp2
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_os, stride_oh, stride_od,
    stride_tos, stride_toh, stride_top,  # tmp_out [S, H, P, HEAD_DIM] (last stride 1)
    stride_tms, stride_tmh,  # tmp_m / tmp_l [S, H, P] (last stride 1)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PARTITION: tl.constexpr,
    SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + seq)
    if SPLIT:
        part = tl.program_id(2)
        start = part * PARTITION
        end = tl.minimum(start + PARTITION, ctx)
    else:
        start = 0
        end = ctx

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE_N)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32) * qk_scale  # scale folded into q once, in fp32
    if USE_DOT:
        if not DOT_FP32:
            q = q.to(k_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh
    for tile_start in range(start, end, TILE_N):
        t = tile_start + offs_n
        t_mask = t < end
        # the block-table gather of §4.1: logical block -> physical block (int64 before any stride product)
        block = tl.load(bt_row + (t // BLOCK_SIZE) * stride_btb, mask=t_mask, other=0).to(tl.int64)
        offset = (t % BLOCK_SIZE).to(tl.int64)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_head + block[:, None] * stride_kb + offset[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        if USE_DOT:
            if DOT_FP32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
        else:  # one query head per program (MHA): a vector-matrix product, no padding to 16 rows
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        s = tl.where(t_mask[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v = tl.load(v_head + block[:, None] * stride_vb + offset[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        if USE_DOT:
            if DOT_FP32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # partial results of this partition; the reduce kernel rescales and normalises them
        to = tmp_out_ptr + seq * stride_tos + heads[:, None] * stride_toh + part * stride_top + offs_d[None, :]
        tl.store(to, acc, mask=out_mask)
        tm = seq * stride_tms + heads * stride_tmh + part
        tl.store(tmp_m_ptr + tm, m_i, mask=g_mask)
        tl.store(tmp_l_ptr + tm, l_i, mask=g_mask)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # empty context -> zeros, not NaN
        o = acc / l_safe[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _paged_attn_reduce_kernel(
    out_ptr, tmp_out_ptr, tmp_m_ptr, tmp_l_ptr, ctx_ptr,
    stride_os, stride_oh, stride_od,
    stride_tos, stride_toh, stride_top,
    stride_tms, stride_tmh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PARTITION: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Combine the partitions of one (sequence, head): out = sum_p 2^(m_p - m) acc_p / sum_p 2^(m_p - m) l_p."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(ctx_ptr + seq)
    n_parts = tl.cdiv(ctx, PARTITION)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs_p < n_parts
    d_mask = offs_d < HEAD_DIM
    tm = seq * stride_tms + head * stride_tmh + offs_p
    m = tl.load(tmp_m_ptr + tm, mask=p_mask, other=float("-inf"))
    l = tl.load(tmp_l_ptr + tm, mask=p_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # no partitions (empty context): avoid inf - inf
    w = tl.where(p_mask, tl.exp2(m - m_max), 0.0)
    l_tot = tl.sum(l * w, axis=0)
    acc = tl.load(tmp_out_ptr + seq * stride_tos + head * stride_toh + offs_p[:, None] * stride_top + offs_d[None, :],
                  mask=p_mask[:, None] & d_mask[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0)
    o = o / tl.where(l_tot > 0.0, l_tot, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=d_mask)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: any small number; only the heuristic's threshold depends on it


def use_split_kv(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device,
                 partition_size: int = _DEFAULT_PARTITION) -> bool:
    """The split-KV heuristic: split when the context spans more than one partition and the (sequence, kv head)
    grid alone would leave SMs idle (fewer programs than twice the SM count)."""
    if max_context <= partition_size:
        return False
    return num_seqs * num_kv_heads < 2 * _num_sms(device)


def _tile_tokens(head_dim: int, interpret: bool) -> int:
    if interpret:
        return 16  # the interpreter's cost is per op, not per element: small tiles keep masks cheap to test
    return 64 if head_dim <= 128 else 32


def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                    context_lens: Tensor, scale: float, *, split_kv: Optional[bool] = None,
                    partition_size: Optional[int] = None, max_context_len: Optional[int] = None,
                    tile_tokens: Optional[int] = None, out: Optional[Tensor] = None) -> Tensor:
    """Triton paged attention for decode; same contract as :func:`pagedattn.kernels.reference.paged_attention_ref`.

    Extra keyword arguments (all optional): ``split_kv`` forces (True) or forbids (False) the split-KV path, else
    :func:`use_split_kv` decides; ``partition_size`` (tokens per partition, a multiple of the tile, default 512);
    ``max_context_len`` an upper bound on ``context_lens`` used to size the split grid (default: the block
    table's capacity, which avoids a device->host sync); ``tile_tokens`` (power of two >= 16); ``out`` a
    preallocated output.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, head_dim_k = key_cache.shape
    assert head_dim_k == head_dim and value_cache.shape == key_cache.shape, "cache shape mismatch"
    assert num_heads % num_kv_heads == 0, f"num_heads={num_heads} not a multiple of num_kv_heads={num_kv_heads}"
    assert block_size & (block_size - 1) == 0, f"block_size={block_size} must be a power of two"
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if block_tables.dtype not in (torch.int32, torch.int64):
        block_tables = block_tables.to(torch.int32)
    context_lens = context_lens.to(torch.int32)

    tile = tile_tokens or _tile_tokens(head_dim, INTERPRET)
    part = partition_size or max(_DEFAULT_PARTITION, tile)
    assert part % tile == 0, f"partition_size={part} must be a multiple of the tile ({tile} tokens)"
    max_ctx = max_context_len if max_context_len is not None else block_tables.shape[1] * block_size
    if split_kv is None:
        split_kv = use_split_kv(num_seqs, num_kv_heads, max_ctx, query.device, part)

    use_dot = group > 1
    block_g = max(16, triton.next_power_of_2(group)) if use_dot else 1
    block_d = max(16, triton.next_power_of_2(head_dim))
    dot_fp32 = INTERPRET or key_cache.dtype == torch.float32
    qk_scale = float(scale) * _LOG2E
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, BLOCK_G=block_g, BLOCK_SIZE=block_size,
                  TILE_N=tile, PARTITION=part, USE_DOT=use_dot, DOT_FP32=dot_fp32)
    args = (query, key_cache, value_cache, block_tables, context_lens, qk_scale,
            *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(), *out.stride())

    if not split_kv:
        _paged_attn_kernel[(num_seqs, num_kv_heads, 1)](
            out, out, out, out, *args, 0, 0, 0, 0, 0, SPLIT=False, **common)
        return out

    n_parts = triton.cdiv(max(int(max_ctx), 1), part)
    tmp_out = torch.empty((num_seqs, num_heads, n_parts, head_dim), dtype=torch.float32, device=query.device)
    tmp_m = torch.empty((num_seqs, num_heads, n_parts), dtype=torch.float32, device=query.device)
    tmp_l = torch.empty_like(tmp_m)
    _paged_attn_kernel[(num_seqs, num_kv_heads, n_parts)](
        out, tmp_out, tmp_m, tmp_l, *args, *tmp_out.stride()[:3], *tmp_m.stride()[:2], SPLIT=True, **common)
    _paged_attn_reduce_kernel[(num_seqs, num_heads)](
        out, tmp_out, tmp_m, tmp_l, context_lens, *out.stride(), *tmp_out.stride()[:3], *tmp_m.stride()[:2],
        HEAD_DIM=head_dim, BLOCK_D=block_d, PARTITION=part, BLOCK_P=max(2, triton.next_power_of_2(n_parts)))
    return out


# ----------------------------------------------------------------------------------------------------------------
# KV-cache write and block copies


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kct, stride_kch, stride_kcd,
    stride_vcb, stride_vct, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per new token: copy its ``[num_kv_heads, head_dim]`` K and V into slot ``slot_mapping[token]``;
    a negative slot (padding) writes nothing."""
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slots = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot  # broadcast the skip flag over the tile
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & (slots >= 0)
    tok64 = tok.to(tl.int64)
    k = tl.load(key_ptr + tok64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + tok64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    kc = kc_ptr + block * stride_kcb + offset * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
    vc = vc_ptr + block * stride_vcb + offset * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                      slot_mapping: Tensor) -> None:
    """Triton KV-cache write (§4.1); same contract as :func:`reference.reshape_and_cache_ref`."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_size = key_cache.shape[1]
    assert block_size & (block_size - 1) == 0, f"block_size={block_size} must be a power of two"
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size)


@triton.jit
def _copy_blocks_kernel(k_ptr, v_ptr, mapping_ptr, stride_kb, stride_vb,
                        BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr):
    """Grid ``(pairs, chunks)``: copy ``CHUNK`` elements of block ``src`` to block ``dst`` in one layer's K and V
    (each block is contiguous: ``block_size * num_kv_heads * head_dim`` elements)."""
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    tl.store(k_ptr + dst * stride_kb + offs, tl.load(k_ptr + src * stride_kb + offs, mask=mask), mask=mask)
    tl.store(v_ptr + dst * stride_vb + offs, tl.load(v_ptr + src * stride_vb + offs, mask=mask), mask=mask)


def copy_blocks(key_caches: list[Tensor], value_caches: list[Tensor], block_mapping) -> None:
    """Triton batched block copy for copy-on-write (§4.4); same contract as :func:`reference.copy_blocks_ref`.

    One launch per layer copies every ``(src, dst)`` pair of that layer's K and V. A layer whose blocks are not
    contiguous in memory falls back to torch indexing.
    """
    if not key_caches:
        return
    mapping = as_block_mapping(block_mapping, key_caches[0].device).contiguous()
    n = mapping.shape[0]
    if n == 0:
        return
    for kc, vc in zip(key_caches, value_caches):
        numel = kc[0].numel()
        if not (kc[0].is_contiguous() and vc[0].is_contiguous()):
            kc[mapping[:, 1]] = kc[mapping[:, 0]]
            vc[mapping[:, 1]] = vc[mapping[:, 0]]
            continue
        chunk = min(triton.next_power_of_2(numel), 4096 if not INTERPRET else 1 << 16)
        _copy_blocks_kernel[(n, triton.cdiv(numel, chunk))](
            kc, vc, mapping, kc.stride(0), vc.stride(0), BLOCK_NUMEL=numel, CHUNK=chunk)


def swap_blocks(src_cache: Tensor, dst_cache: Tensor, block_mapping) -> None:
    """Swap blocks between a device cache and a CPU cache (§4.5). A device<->host transfer is a DMA, not a kernel:
    this is :func:`reference.swap_blocks_ref` (one gather, one transfer, one scatter)."""
    swap_blocks_ref(src_cache, dst_cache, block_mapping)
