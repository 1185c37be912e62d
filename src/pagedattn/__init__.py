"""pagedattn: a reproducible replication of vLLM / PagedAttention (Kwon et al., SOSP 2023, arXiv:2309.06180).

The public API, named as vLLM names it::

    from pagedattn import LLM, SamplingParams

    llm = LLM(model)  # a Hugging Face OPT or Llama model (or a checkpoint folder), served through a paged KV cache
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

``LLMEngine`` (``add_request`` / ``step`` / ``abort_request``) and ``EngineArgs`` are the engine underneath;
``RequestOutput`` and ``CompletionOutput`` are what they return. Each name is imported from the module that defines
it when first used, so that ``import pagedattn.repro.sim.simulator`` (the simulator, which needs no torch) stays light.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: public name -> the module that defines it
_PUBLIC = {"LLM": "pagedattn.llm", "LLMEngine": "pagedattn.engine", "EngineArgs": "pagedattn.engine",
           "SamplingParams": "pagedattn.sequence", "RequestOutput": "pagedattn.sequence",
           "CompletionOutput": "pagedattn.sequence"}
__all__ = list(_PUBLIC)

if TYPE_CHECKING:
    from pagedattn.engine import EngineArgs, LLMEngine
    from pagedattn.llm import LLM
    from pagedattn.sequence import CompletionOutput, RequestOutput, SamplingParams


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pagedattn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
