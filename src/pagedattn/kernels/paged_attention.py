"""Triton PagedAttention decode kernel (§4.1 and §5.1 of Kwon et al., SOSP 2023).

Each program handles one sequence and either one kv head with all the ``num_heads // num_kv_heads`` query heads that
share it (GQA: each K/V byte is read once per group, the query heads are the rows of a ``tl.dot``), or, with MHA,
``HEADS`` consecutive heads at once (``[TILE_N, HEADS, head_dim]`` tiles: in the cache layout ``[block, token,
kv head, head_dim]`` a token's heads are adjacent, so each token's load is ``HEADS x head_dim`` contiguous elements,
1 KB for 4 fp16 heads of 128, and one block-table read serves all of them; vLLM's v1/v2 kernels run one head per
thread block, FlashInfer's decode kernel one kv head per block with the query group spread over its threads). A
program walks the sequence's context in *tiles* of ``TILE_N`` tokens. A tile is gathered through the block table
token by token: logical block ``t // BLOCK_SIZE``, physical block ``block_tables[seq, t // BLOCK_SIZE]``, offset
``t % BLOCK_SIZE``; with block size <= TILE_N a tile covers several blocks, with larger blocks a tile is a slice of
one block, so any power-of-two block size from 1 to 256 works. Scores and the output are accumulated in fp32 with
the online (streaming) softmax, so the kernel never materialises the whole context (§5.1: "fused block read and
attention").

When the (sequence, head block) grid is too small to fill the GPU (small batch), a *split-KV* path (flash-decoding;
vLLM's ``paged_attention_v2`` with its reduce kernel, FlashInfer's split-k decode) also splits each context into
partitions: each partition writes its un-normalised output, running max and running sum, and a reduce kernel
rescales and combines them. The partition size follows FlashInfer's decode planner
(``PartitionPagedKVCacheBinarySearchMinNumPagePerBatch``): the smallest size, here a power of two from 128 tokens,
whose programs still fit in one wave of ``_PROGRAMS_PER_SM`` programs per SM (an assumption, not tuned on a GPU):
on a 132-SM H200 a batch of 8 at context 1024 splits into 256-token partitions with OPT-13B's 40 heads (10 programs
per sequence) and 128-token ones with 8 kv heads, where the fixed 512 of before never split 8 x 40 heads. vLLM fixes
512 tokens. :func:`split_partition` decides; ``split_kv=True/False`` forces it.

All strides are passed explicitly (caches and queries may be views), and block ids are cast to int64 before they
are multiplied by a stride, so caches larger than 2**31 elements are addressed correctly.

Every wrapper builds its launches with a ``plan_*`` function (grid, arguments, constexprs, warps, stages) and then
runs them; :mod:`pagedattn.kernels.compile_check` compiles the same plans ahead of time for sm_80 / sm_90 and checks
registers, spills and shared memory. The tile (``TILE_N`` tokens) and the warps / stages are chosen per head dim,
dtype and GQA group by :func:`attention_tile_config` so that no configuration the engine runs spills registers.
With GQA the program's query heads form the rows of a ``tl.dot`` (padded to 16); with MHA the scores and ``P.V`` are
products of the ``[TILE_N, HEADS, head_dim]`` tile reduced along one axis (no padding to 16).

Under ``TRITON_INTERPRET=1`` (CPU, tests) the kernels run in Triton's interpreter; there ``tl.dot`` on bf16 operands
is unreliable, so the dot operands are cast to fp32 (``DOT_FP32``). On a GPU, fp16/bf16 caches feed ``tl.dot`` in their
own dtype (fp32 accumulation) and fp32 caches use ``input_precision="ieee"`` (no TF32).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedattn.kernels import use_triton_interpreter

#: True when the kernels were defined under Triton's CPU interpreter: triton.jit reads the choice when the kernels
#: below are defined, so it is made (``use_triton_interpreter``) before that.
INTERPRET = use_triton_interpreter()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch import Tensor  # noqa: E402

from pagedattn.kernels.reference import as_block_mapping, swap_blocks_ref  # noqa: E402

__all__ = ["paged_attention", "reshape_and_cache", "copy_blocks", "swap_blocks", "use_split_kv", "INTERPRET",
           "Launch", "TileConfig", "attention_tile_config", "plan_paged_attention", "plan_reshape_and_cache",
           "plan_copy_blocks"]

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
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PARTITION: tl.constexpr,
    SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)  # GQA: the kv head; MHA: the block of HEADS heads
    ctx = tl.load(ctx_ptr + seq)
    if SPLIT:
        part = tl.program_id(2)
        start = part * PARTITION
        end = tl.minimum(start + PARTITION, ctx)
    else:
        start = 0
        end = ctx

    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE_N)
    d_mask = offs_d < HEAD_DIM
    if USE_DOT:  # GQA: the GROUP query heads of kv head ``kvh``
        offs_g = tl.arange(0, BLOCK_G)
        heads = kvh * GROUP + offs_g
        g_mask = offs_g < GROUP
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    else:  # MHA: heads kvh * HEADS ... (query head == kv head)
        heads = kvh * HEADS + tl.arange(0, HEADS)
        g_mask = heads < NUM_KV_HEADS
        m_i = tl.full([HEADS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([HEADS], dtype=tl.float32)
        acc = tl.zeros([HEADS, BLOCK_D], dtype=tl.float32)
        # the HEADS heads' offsets within a token's row: a token's loads are HEADS x HEAD_DIM adjacent elements
        h_off_k = heads.to(tl.int64)[None, :, None] * stride_kh + offs_d[None, None, :] * stride_kd
        h_off_v = heads.to(tl.int64)[None, :, None] * stride_vh + offs_d[None, None, :] * stride_vd
        hd_mask = g_mask[None, :, None] & d_mask[None, None, :]

    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32) * qk_scale  # scale folded into q once, in fp32
    if USE_DOT:
        if not DOT_FP32:
            q = q.to(k_ptr.dtype.element_ty)

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh
    for tile_start in range(start, end, TILE_N):
        t = tile_start + offs_n
        t_mask = t < end
        # the block-table gather of §4.1: logical block -> physical block (int64 before any stride product)
        block = tl.load(bt_row + (t // BLOCK_SIZE) * stride_btb, mask=t_mask, other=0).to(tl.int64)
        offset = (t % BLOCK_SIZE).to(tl.int64)
        if USE_DOT:
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = tl.load(k_head + block[:, None] * stride_kb + offset[:, None] * stride_kt
                        + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
            if DOT_FP32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(t_mask[None, :], s, float("-inf"))  # [BLOCK_G, TILE_N]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_head + block[:, None] * stride_vb + offset[:, None] * stride_vt
                        + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
            if DOT_FP32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
        else:  # MHA: [TILE_N, HEADS, BLOCK_D] tiles, products reduced over d (scores) and over tokens (P.V)
            kv_mask = t_mask[:, None, None] & hd_mask
            tok_k = (block * stride_kb + offset * stride_kt)[:, None, None]
            k = tl.load(k_ptr + tok_k + h_off_k, mask=kv_mask, other=0.0)
            s = tl.sum(k.to(tl.float32) * q[None, :, :], axis=2)  # [TILE_N, HEADS]
            s = tl.where(t_mask[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            tok_v = (block * stride_vb + offset * stride_vt)[:, None, None]
            v = tl.load(v_ptr + tok_v + h_off_v, mask=kv_mask, other=0.0)
            pv = tl.sum(p[:, :, None] * v.to(tl.float32), axis=0)  # [HEADS, BLOCK_D]
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
    """Combine the partitions of one (sequence, head): out = sum_p 2^(m_p - m) acc_p / sum_p 2^(m_p - m) l_p.

    The partitions are read ``BLOCK_P`` at a time (a first pass finds the maximum ``m``, a second sums), so the tile
    stays ``[BLOCK_P, BLOCK_D]`` however long the context."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(ctx_ptr + seq)
    n_parts = tl.cdiv(ctx, PARTITION)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    tm_row = seq * stride_tms + head * stride_tmh
    to_row = tmp_out_ptr + seq * stride_tos + head * stride_toh
    m_vec = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        p_mask = p0 + offs_p < n_parts
        m_vec = tl.maximum(m_vec, tl.load(tmp_m_ptr + tm_row + p0 + offs_p, mask=p_mask, other=float("-inf")))
    m_max = tl.max(m_vec, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # no partitions (empty context): avoid inf - inf
    l_vec = tl.zeros([BLOCK_P], dtype=tl.float32)
    o = tl.zeros([BLOCK_D], dtype=tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        p_mask = p0 + offs_p < n_parts
        m = tl.load(tmp_m_ptr + tm_row + p0 + offs_p, mask=p_mask, other=float("-inf"))
        w = tl.where(p_mask, tl.exp2(m - m_max), 0.0)
        l_vec += w * tl.load(tmp_l_ptr + tm_row + p0 + offs_p, mask=p_mask, other=0.0)
        acc = tl.load(to_row + (p0 + offs_p)[:, None] * stride_top + offs_d[None, :],
                      mask=p_mask[:, None] & d_mask[None, :], other=0.0)
        o += tl.sum(acc * w[:, None], axis=0)
    l_tot = tl.sum(l_vec, axis=0)
    o = o / tl.where(l_tot > 0.0, l_tot, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=d_mask)


# ----------------------------------------------------------------------------------------------------------------
# Launch plans: the wrappers below and the ahead-of-time compile checks (pagedattn.kernels.compile_check) both build
# their launches here, so the checks compile exactly the constexprs, warps and stages a real launch uses.


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)``.

    ``fp_fusion=False`` forbids the compiler to contract ``a * b + c`` into one FMA (Triton's ``enable_fp_fusion``,
    on by default): a kernel that must round as torch's separate elementwise ops do (RoPE in fp32) sets it."""

    kernel: Any  # a Triton JIT function, launched as kernel[grid](...)
    grid: tuple
    args: tuple
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 3
    fp_fusion: bool = True

    def __call__(self) -> None:
        extra = {} if self.fp_fusion else {"enable_fp_fusion": False}
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages,
                               **extra)


@dataclass(frozen=True)
class TileConfig:
    """Tokens per tile, heads per program (MHA) and the launch's warps / pipeline stages for one (head dim, dtype,
    GQA group) case."""

    tile_tokens: int
    num_warps: int
    num_stages: int
    heads: int = 1  # MHA: consecutive heads per program (GQA: the kv head's whole query group, always)


def attention_tile_config(head_dim: int, dtype: torch.dtype, group: int, interpret: bool) -> TileConfig:
    """The attention kernel's tile and launch shape, chosen per case so that no engine configuration spills
    registers on sm_80 / sm_90 (§5.1; see ``make kernels-compile`` and results/02_attention_kernel/compile_table.csv).

    The register footprint per thread grows with ``TILE_N x HEADS x BLOCK_D`` (the K and V tiles, in fp32 on the MHA
    path) over the number of threads; GQA programs also hold ``BLOCK_G`` query rows and their ``[BLOCK_G, TILE_N]``
    scores. MHA programs take 4 heads of up to 128 dims: 16-token tiles on 4 warps up to head dim 64, 32-token tiles on
    8 warps at 128 (32 x 4 x 128 = 16K elements per tile, 64 per thread; 16-token tiles spilled 8 bytes there on sm_90
    in bf16), 16-token tiles on 8 warps for head dims 80 and 96 (32-token tiles spilled 4 bytes on the split path at
    block 16); 2 heads above 128. These choices come from the compile table, not from GPU timings.
    """
    if interpret:  # the interpreter's cost is per op, not per element: small tiles, cheap masks; 2 heads per
        return TileConfig(16, 4, 1, heads=2 if group == 1 else 1)  # MHA program, so the head mask is exercised
    block_d = max(16, triton.next_power_of_2(head_dim))
    if group == 1:  # MHA: fp32 products of [TILE_N, HEADS, BLOCK_D]
        if block_d <= 64:
            return TileConfig(16, 4, 2, heads=4)
        if block_d <= 128:  # head dims 80 / 96 (masked lanes) spill 4 bytes with 32-token tiles at block 16
            return TileConfig(32 if head_dim == block_d else 16, 8, 2, heads=4)
        return TileConfig(16, 8, 2, heads=2)
    if dtype == torch.float32:  # IEEE fp32 tl.dot: operands in fp32
        return TileConfig(32, 4, 2)
    return TileConfig(64 if block_d <= 128 else 32, 4, 2)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: any small number; only the heuristic's threshold depends on it


#: programs one SM is assumed to run at once (4-8 warps each): the split path fills one wave of these
_PROGRAMS_PER_SM = 4
#: the smallest partition of the split path, in tokens (FlashInfer's decode planner starts at 128 tokens too)
_MIN_PARTITION = 128


def split_partition(num_seqs: int, programs_per_seq: int, max_context: int, device: torch.device) -> Optional[int]:
    """The split-KV partition size for a decode batch, or None when the kernel should not split.

    As FlashInfer's decode planner: split only when the ``num_seqs x programs_per_seq`` grid leaves part of one wave
    (``_PROGRAMS_PER_SM`` per SM) empty and a context spans more than ``_MIN_PARTITION`` tokens; then take the
    smallest partition (a power of two from ``_MIN_PARTITION``, so few variants compile) whose grid still fits in
    that wave."""
    wave = _PROGRAMS_PER_SM * _num_sms(device)
    if max_context <= _MIN_PARTITION or num_seqs * programs_per_seq >= wave:
        return None
    part = _MIN_PARTITION
    while part < max_context and num_seqs * programs_per_seq * triton.cdiv(max_context, part) > wave:
        part *= 2
    return None if part >= max_context else part


def use_split_kv(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device,
                 heads_per_program: int = 1) -> bool:
    """Whether :func:`plan_paged_attention` takes the split-KV path for this batch (:func:`split_partition`)."""
    programs = triton.cdiv(num_kv_heads, heads_per_program)
    return split_partition(num_seqs, programs, max_context, device) is not None


#: partitions the reduce kernel combines per loop iteration
_REDUCE_CHUNK = 16


def plan_paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                         context_lens: Tensor, scale: float, out: Tensor, *, split_kv: Optional[bool] = None,
                         partition_size: Optional[int] = None, max_context_len: Optional[int] = None,
                         tile_tokens: Optional[int] = None) -> list[Launch]:
    """The launches of :func:`paged_attention` (one, or the split pass and its reduce), allocating the split
    path's partial results. Works on ``meta`` tensors (no memory, no device): the compile checks call it so."""
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, head_dim_k = key_cache.shape
    if head_dim_k != head_dim or value_cache.shape != key_cache.shape:
        raise ValueError(f"cache shape mismatch: query head_dim {head_dim}, key_cache {tuple(key_cache.shape)}, "
                         f"value_cache {tuple(value_cache.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} must be a power of two")
    group = num_heads // num_kv_heads
    cfg = attention_tile_config(head_dim, key_cache.dtype, group, INTERPRET)
    use_dot = group > 1
    heads = 1 if use_dot else min(cfg.heads, triton.next_power_of_2(num_kv_heads))
    programs_per_seq = num_kv_heads if use_dot else triton.cdiv(num_kv_heads, heads)
    max_ctx = max_context_len if max_context_len is not None else block_tables.shape[1] * block_size
    if split_kv is not False and partition_size is None:
        partition_size = split_partition(num_seqs, programs_per_seq, max_ctx, query.device)
        if split_kv is None:
            split_kv = partition_size is not None
        partition_size = partition_size or _DEFAULT_PARTITION  # forced split with no wave to fill: vLLM's 512
    split_kv = bool(split_kv)
    tile = tile_tokens or cfg.tile_tokens
    if partition_size and not tile_tokens:  # a small forced partition (tests): the largest tile that divides it
        tile = math.gcd(tile, partition_size)
    part = partition_size or max(_DEFAULT_PARTITION, tile)
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"the tile must be a power of two >= 16 tokens, got {tile} (tile_tokens={tile_tokens}, "
                         f"partition_size={partition_size})")
    if part % tile:
        raise ValueError(f"partition_size={part} must be a multiple of the tile ({tile} tokens)")
    block_g = max(16, triton.next_power_of_2(group)) if use_dot else 1
    block_d = max(16, triton.next_power_of_2(head_dim))
    dot_fp32 = INTERPRET or key_cache.dtype == torch.float32
    qk_scale = float(scale) * _LOG2E
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, BLOCK_G=block_g, NUM_KV_HEADS=num_kv_heads,
                  HEADS=heads, BLOCK_SIZE=block_size, TILE_N=tile, PARTITION=part, USE_DOT=use_dot,
                  DOT_FP32=dot_fp32)
    shape: dict[str, Any] = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args = (query, key_cache, value_cache, block_tables, context_lens, qk_scale,
            *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(), *out.stride())
    if not split_kv:
        return [Launch(_paged_attn_kernel, (num_seqs, programs_per_seq, 1), (out, out, out, out, *args, 0, 0, 0, 0, 0),
                       dict(common, SPLIT=False), **shape)]
    n_parts = triton.cdiv(max(int(max_ctx), 1), part)
    tmp_out = torch.empty((num_seqs, num_heads, n_parts, head_dim), dtype=torch.float32, device=query.device)
    tmp_m = torch.empty((num_seqs, num_heads, n_parts), dtype=torch.float32, device=query.device)
    tmp_l = torch.empty_like(tmp_m)
    tmp_strides = (*tmp_out.stride()[:3], *tmp_m.stride()[:2])
    return [
        Launch(_paged_attn_kernel, (num_seqs, programs_per_seq, n_parts),
               (out, tmp_out, tmp_m, tmp_l, *args, *tmp_strides),
               dict(common, SPLIT=True), **shape),
        Launch(_paged_attn_reduce_kernel, (num_seqs, num_heads),
               (out, tmp_out, tmp_m, tmp_l, context_lens, *out.stride(), *tmp_strides),
               dict(HEAD_DIM=head_dim, BLOCK_D=block_d, PARTITION=part, BLOCK_P=_REDUCE_CHUNK),
               num_warps=4, num_stages=1),
    ]


def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                    context_lens: Tensor, scale: float, *, split_kv: Optional[bool] = None,
                    partition_size: Optional[int] = None, max_context_len: Optional[int] = None,
                    tile_tokens: Optional[int] = None, out: Optional[Tensor] = None) -> Tensor:
    """Triton paged attention for decode; same contract as :func:`pagedattn.kernels.reference.paged_attention_ref`.

    Extra keyword arguments (all optional): ``split_kv`` forces (True) or forbids (False) the split-KV path, else
    :func:`split_partition` decides; ``partition_size`` (tokens per partition, a multiple of 16; default
    :func:`split_partition`'s choice, or 512 when a split is forced where it would not split);
    ``max_context_len`` an upper bound on ``context_lens`` used to size the split grid (default: the block
    table's capacity, which avoids a device->host sync); ``tile_tokens`` (power of two >= 16, default
    :func:`attention_tile_config`); ``out`` a preallocated output.
    """
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    if block_tables.dtype not in (torch.int32, torch.int64):
        block_tables = block_tables.to(torch.int32)
    for launch in plan_paged_attention(query, key_cache, value_cache, block_tables, context_lens.to(torch.int32),
                                       scale, out, split_kv=split_kv, partition_size=partition_size,
                                       max_context_len=max_context_len, tile_tokens=tile_tokens):
        launch()
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


def plan_reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                           slot_mapping: Tensor) -> Launch:
    """The launch of :func:`reshape_and_cache`: one program per new token."""
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = key_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} must be a power of two")
    return Launch(_reshape_and_cache_kernel, (num_tokens,),
                  (key, value, key_cache, value_cache, slot_mapping,
                   *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride()),
                  dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
                       BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size))


def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                      slot_mapping: Tensor) -> None:
    """Triton KV-cache write (§4.1); same contract as :func:`reference.reshape_and_cache_ref`."""
    if key.shape[0] == 0:
        return
    plan_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)()


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


def plan_copy_blocks(key_cache: Tensor, value_cache: Tensor, mapping: Tensor) -> Launch:
    """The launch of :func:`copy_blocks` for one layer whose blocks are contiguous: grid ``(pairs, chunks)``."""
    numel = key_cache[0].numel()
    chunk = min(triton.next_power_of_2(numel), 4096 if not INTERPRET else 1 << 16)
    return Launch(_copy_blocks_kernel, (mapping.shape[0], triton.cdiv(numel, chunk)),
                  (key_cache, value_cache, mapping, key_cache.stride(0), value_cache.stride(0)),
                  dict(BLOCK_NUMEL=numel, CHUNK=chunk))


def copy_blocks(key_caches: list[Tensor], value_caches: list[Tensor], block_mapping) -> None:
    """Triton batched block copy for copy-on-write (§4.4); same contract as :func:`reference.copy_blocks_ref`.

    One launch per layer copies every ``(src, dst)`` pair of that layer's K and V. A layer whose blocks are not
    contiguous in memory falls back to torch indexing.
    """
    if not key_caches:
        return
    mapping = as_block_mapping(block_mapping, key_caches[0].device).contiguous()
    if mapping.shape[0] == 0:
        return
    for kc, vc in zip(key_caches, value_caches):
        if not (kc[0].is_contiguous() and vc[0].is_contiguous()):
            kc[mapping[:, 1]] = kc[mapping[:, 0]]
            vc[mapping[:, 1]] = vc[mapping[:, 0]]
            continue
        plan_copy_blocks(kc, vc, mapping)()


def swap_blocks(src_cache: Tensor, dst_cache: Tensor, block_mapping) -> None:
    """Swap blocks between a device cache and a CPU cache (§4.5). A device<->host transfer is a DMA, not a kernel:
    this is :func:`reference.swap_blocks_ref` (one gather, one transfer, one scatter)."""
    swap_blocks_ref(src_cache, dst_cache, block_mapping)
