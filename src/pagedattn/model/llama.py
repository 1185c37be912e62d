"""The Llama family (Llama 1/2/3, incl. GQA) as a paged-attention decoder, nanoGPT style.

Pre-norm decoder layers: RMSNorm -> attention with rotary position embeddings (RoPE) on q and k -> residual;
RMSNorm -> SwiGLU MLP (``down(silu(gate(x)) * up(x))``) -> residual. Grouped-query attention stores only
``num_key_value_heads`` K/V heads in the paged cache, which shrinks the per-token KV bytes (§3; LLaMA-2-70B with
GQA-8: 320 KB per token). Parameter names mirror transformers' ``LlamaForCausalLM`` so its state dict loads as is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedattn.kernels import cpu
from pagedattn.model import fused_ops
from pagedattn.model.activations import activation
from pagedattn.model.attention import AttentionMetadata, PagedAttention
from pagedattn.model.fused import FusedLinear, Linear


def rope_parameters(config) -> tuple[str, float]:
    """``(rope_type, rope_theta)`` from a transformers 4.x (``rope_theta``/``rope_scaling``) or 5.x
    (``rope_parameters``) config."""
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" in params and not isinstance(params.get("rope_theta"), dict):
        return params.get("rope_type", "default"), float(params["rope_theta"])
    scaling = getattr(config, "rope_scaling", None) or {}
    return scaling.get("rope_type", scaling.get("type", "default")), float(getattr(config, "rope_theta", 10000.0))


# RoPE variants whose frequencies are fixed at load time, as in transformers, over the positions the engine allows
# (``max_model_len <= max_position_embeddings``, so "dynamic" never rescales). "longrope" is refused: transformers
# switches between its short and long factors per forward call, by the largest position in that call, so a token's
# cached K depends on how its sequence was cut into calls (prefill, decode, recompute, a cached prefix); a paged
# cache that recomputes or shares prefixes cannot reproduce that.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


class RotaryEmbedding(nn.Module):
    """RoPE as transformers computes it (rotate-half layout; inverse frequencies in fp32)."""

    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        rope_type, theta = rope_parameters(config)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"RoPE type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                             + ("; longrope's frequencies depend on how a sequence is split into forward calls"
                                if rope_type == "longrope" else ""))
        partial = (getattr(config, "rope_parameters", None) or {}).get(
            "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not supported (RoPE over the whole head only)")
        if rope_type == "default":
            inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
            self.attention_scaling = 1.0
        else:  # llama3, linear, dynamic, yarn ...: the formula lives in transformers
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            with torch.device("cpu"):  # also when the model is being built on the meta device
                inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        self.inv_freq = inv_freq.float()  # a plain attribute, not a buffer: it must stay fp32 under .to(dtype)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(cos, sin_rot)``, each ``[T, 1, head_dim]``, for :func:`apply_rope`: transformers' ``cos`` and ``sin``
        (``cat(freqs, freqs)``), with the first half of ``sin`` negated. Computed once per forward pass."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # as transformers lays it out, so that cos/sin round the same
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        half = freqs.shape[-1]
        return cos[:, None], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None]


def apply_rope(x: Tensor, cos: Tensor, sin_rot: Tensor, in_place: bool = False) -> Tensor:
    """RoPE on ``x`` ``[T, heads, head_dim]`` (``cos``, ``sin_rot`` from :class:`RotaryEmbedding`).

    transformers computes ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``. Here
    ``roll(x) = cat(x2, x1)`` and ``sin_rot = cat(-sin1, sin2)``: ``(-a) * b == a * (-b)`` exactly in IEEE arithmetic,
    so the result is bit-identical, in 4 torch calls instead of 8. ``in_place=True`` lets fp32/bf16 CPU tensors be
    rotated in place by one C++ call (:func:`pagedattn.kernels.cpu.rope_cpu`, bit-identical too).
    """
    if in_place and cpu.takes(x, cos, sin_rot, dtypes=cpu.LAYER_DTYPES):
        return cpu.rope_cpu(x, cos, sin_rot)
    if in_place and fused_ops.on_gpu(x):  # one Triton launch, the same rounding
        return fused_ops.rope_launch(x, cos, sin_rot)
    return fused_ops.rope_ref(x, cos, sin_rot)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if cpu.takes(x, self.weight, dtypes=cpu.LAYER_DTYPES):  # one C++ call: torch's costs 35-80 us at decode shapes
            return cpu.rms_norm_cpu(x.contiguous(), self.weight, self.eps)
        if fused_ops.on_gpu(x):  # one Triton launch
            return fused_ops.rms_norm_launch(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op, bit-identical to the lines below in fp32 (checked in tests)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return fused_ops.rms_norm_ref(x, self.weight, self.eps)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """``(norm(residual + x), residual + x)``: the decoder layer's residual add and the next norm. In one C++
        call for fp32/bf16 CPU tensors and in one Triton launch on a GPU, which add ``x`` into ``residual`` in place
        (the layer owns its residual stream at inference)."""
        if cpu.takes(x, residual, self.weight, dtypes=cpu.LAYER_DTYPES) and residual.is_contiguous():
            return cpu.rms_norm_cpu(x.contiguous(), self.weight, self.eps, residual=residual), residual
        if fused_ops.on_gpu(x) and residual.is_contiguous():
            return fused_ops.rms_norm_launch(x.contiguous(), self.weight, self.eps, residual=residual), residual
        h = residual + x
        return self(h), h


class LlamaAttention(nn.Module):
    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        h, kvh, bias = config.num_attention_heads, config.num_key_value_heads, getattr(config, "attention_bias", False)
        self.q_proj = Linear(config.hidden_size, h * head_dim, bias=bias)
        self.k_proj = Linear(config.hidden_size, kvh * head_dim, bias=bias)
        self.v_proj = Linear(config.hidden_size, kvh * head_dim, bias=bias)
        self.o_proj = Linear(h * head_dim, config.hidden_size, bias=bias)
        self.attn = PagedAttention(h, kvh, head_dim, head_dim ** -0.5)
        self.qkv_proj = FusedLinear(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        T, a = x.shape[0], self.attn
        qkv = self.qkv_proj(x)
        heads = a.num_heads + a.num_kv_heads
        qk, v = qkv[:, :heads * a.head_dim].view(T, heads, a.head_dim), qkv[:, heads * a.head_dim:]
        # q and k in one call, in place (qkv is this call's own output); on a GPU the same launch writes K/V
        cached = a.rope_and_cache(qk, v, cos, sin, meta)
        if not cached:
            qk = apply_rope(qk, cos, sin, in_place=True)
        return self.o_proj(a(qk[:, :a.num_heads], qk[:, a.num_heads:], v, meta, kv_cached=cached))


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = activation(config.hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, head_dim)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        normed, x = self.post_attention_layernorm.add_and_norm(self.self_attn(self.input_layernorm(x), cos, sin, meta),
                                                               x)
        return x + self.mlp(normed)


class LlamaModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, head_dim) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], meta) -> hidden [T, hidden]``; ``compute_logits`` applies the head."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight
