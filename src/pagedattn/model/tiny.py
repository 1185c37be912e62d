"""The small random-weight OPT of the CPU-scale runs (transformers' ``OPTForCausalLM``; the paper's model family, §6.1):
what the server's ``tiny:opt`` serves with no weights to load, and what the experiments run where only lengths matter.
No weights can be downloaded here, so every such model is built from a config, seeded."""
from __future__ import annotations

#: The CPU-scale model's shape unless a caller passes its own (``transformers.OPTConfig`` fields); ``ffn_dim`` is
#: 4 x hidden unless given.
TINY_OPT_SHAPE = dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                      max_position_embeddings=512, init_std=0.2)


def tiny_opt(seed: int = 0, **shape):
    """A small random-weight OPT, fp32, eval mode, seeded. ``shape`` overrides ``TINY_OPT_SHAPE`` (``OPTConfig``
    fields). ``init_std=0.2`` keeps the logits far from uniform, so greedy decoding is deterministic."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    cfg = {**TINY_OPT_SHAPE, **shape}
    cfg.setdefault("ffn_dim", 4 * cfg["hidden_size"])
    torch.manual_seed(seed)
    return OPTForCausalLM(OPTConfig(**cfg)).eval()
