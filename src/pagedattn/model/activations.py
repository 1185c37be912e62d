"""The decoders' activation functions, by their transformers config names (OPT's ``activation_function``, Llama's
``hidden_act``), built from torch's own modules: importing ``transformers.activations`` imports ``torch._dynamo``,
2 s of every ``python -m pagedattn.serve`` start on the 2-core VM (2026-12-07), where nothing else does. Each
computes what transformers' ``ACT2FN`` entry of the same name computes (``tests/test_models.py`` checks); any other
name is taken from ``ACT2FN``."""
from __future__ import annotations

from torch import nn

_OWN: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "silu": nn.SiLU, "swish": nn.SiLU, "gelu": nn.GELU}


def activation(name: str) -> nn.Module:
    """The activation module transformers names ``name``."""
    if name in _OWN:
        return _OWN[name]()
    from transformers.activations import ACT2FN

    return ACT2FN[name]
