"""Decoder models that load Hugging Face weights and attend through a paged KV cache (paper §4.1-§4.3).

Each model takes a flat batch (``input_ids [T]``, ``positions [T]``) and an ``AttentionMetadata`` and returns hidden
states; ``compute_logits`` applies the LM head (the executor calls it on each sequence's last token only).
"""
from pagedattn.model.attention import AttentionMetadata, PagedAttention
from pagedattn.model.llama import LlamaForCausalLM
from pagedattn.model.loader import MODEL_REGISTRY, load_model, read_state_dict
from pagedattn.model.opt import OPTForCausalLM

__all__ = ["AttentionMetadata", "PagedAttention", "LlamaForCausalLM", "OPTForCausalLM", "MODEL_REGISTRY",
           "load_model", "read_state_dict"]
