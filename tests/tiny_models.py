"""The tiny random-weight models the engine tests share (one definition each): seeded, fp32, eval mode, with
``initializer_range`` / ``init_std`` 0.2 so that greedy decoding is not degenerate. Keyword arguments override the
config's fields. Imported by test modules (``from tiny_models import tiny_opt``); not a test module."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

OPT = dict(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=256, init_std=0.2, word_embed_proj_dim=64)
#: GQA: 4 query heads share 2 KV heads
LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)


def tiny_opt(**kw) -> OPTForCausalLM:
    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(**{**OPT, **kw})).eval()


def tiny_llama(**kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, **kw})).eval()
