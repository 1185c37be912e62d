"""OPT (Zhang et al., 2022), the paper's model family (§6.1: OPT-13B/66B/175B), as a paged-attention decoder.

Learned absolute positions with OPT's offset of 2 (row ``position + 2`` of ``embed_positions``); LayerNorm before
(125M, 1.3B, ... 175B) or after (350M) each sub-block, per ``do_layer_norm_before``; ReLU MLP; q is scaled before
the attention product, as in the original; ``project_in``/``project_out`` when ``word_embed_proj_dim`` differs from
the hidden size; the LM head is tied to the token embedding. Parameter names mirror transformers'
``OPTForCausalLM`` so its state dict loads as is.
"""
from __future__ import annotations

from torch import Tensor, nn

from pagedattn.model.activations import activation
from pagedattn.model.attention import AttentionMetadata, PagedAttention
from pagedattn.model.fused import FusedLinear, Linear

POSITION_OFFSET = 2  # OPT reserves the first two rows of its position table


class OPTAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d, h, bias = config.hidden_size, config.num_attention_heads, config.enable_bias
        self.head_dim = d // h
        self.scaling = self.head_dim ** -0.5
        self.q_proj = Linear(d, d, bias=bias)
        self.k_proj = Linear(d, d, bias=bias)
        self.v_proj = Linear(d, d, bias=bias)
        self.out_proj = Linear(d, d, bias=bias)
        self.attn = PagedAttention(h, h, self.head_dim, scale=1.0)  # q is pre-scaled
        self.qkv_proj = FusedLinear(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self.out_proj(self.attn(q * self.scaling, k, v, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d, affine = config.hidden_size, getattr(config, "layer_norm_elementwise_affine", True)
        self.pre_norm = config.do_layer_norm_before
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(d, elementwise_affine=affine)
        self.fc1 = Linear(d, config.ffn_dim, bias=config.enable_bias)
        self.fc2 = Linear(config.ffn_dim, d, bias=config.enable_bias)
        self.final_layer_norm = nn.LayerNorm(d, elementwise_affine=affine)
        self.act = activation(config.activation_function)

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        h = self.self_attn(self.self_attn_layer_norm(x) if self.pre_norm else x, meta)
        x = x + h
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.fc2(self.act(self.fc1(self.final_layer_norm(x) if self.pre_norm else x)))
        x = x + h
        return x if self.pre_norm else self.final_layer_norm(x)


class OPTDecoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d, e = config.hidden_size, config.word_embed_proj_dim
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        self.embed_tokens = nn.Embedding(config.vocab_size, e)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, d)
        self.project_in = Linear(e, d, bias=False) if e != d else None
        self.project_out = Linear(d, e, bias=False) if e != d else None
        keep_final = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        self.final_layer_norm = nn.LayerNorm(d, elementwise_affine=affine) if keep_final else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            x = layer(x, meta)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        return x if self.project_out is None else self.project_out(x)


class OPTModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], meta) -> hidden [T, word_embed_proj_dim]``; ``compute_logits``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config)
        self.lm_head = Linear(config.word_embed_proj_dim, config.vocab_size, bias=False)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        return self.model.decoder(input_ids, positions, meta)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.decoder.embed_tokens.weight
