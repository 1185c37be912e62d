"""Paged KV-cache kernels (§4.1, §5.1 of Kwon et al., SOSP 2023): attention over a block table, the KV-cache write,
block copies for copy-on-write (§4.4) and block swaps (§4.5).

Three backends with identical signatures:

- ``"torch"`` (:mod:`pagedattn.kernels.reference`): vectorised torch; the tests' oracle, and the CPU engine's path
  where the CPU kernel does not build.
- ``"cpu"`` (:mod:`pagedattn.kernels.cpu`): decode attention that reads K/V in place in the cache, and the KV-cache
  write, in C++ (compiled on first use with the system's C++ compiler); block copies and swaps are the torch ones.
  The default on a CPU.
- ``"triton"`` (:mod:`pagedattn.kernels.paged_attention`): the Triton kernels; the default on CUDA.

Usage (what the engine calls)::

    from pagedattn import kernels
    ops = kernels.get_backend()            # "auto": triton on CUDA, else cpu (torch where it does not build)
    out = ops.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    ops.copy_blocks(key_caches, value_caches, block_mapping)
    ops.swap_blocks(src_cache, dst_cache, block_mapping)

Triton on a CPU needs its interpreter, and ``triton.jit`` decides interpreted vs compiled *when a kernel is defined*,
i.e. when :mod:`pagedattn.kernels.paged_attention` is first imported (importing ``triton`` itself earlier is fine:
it reads ``TRITON_INTERPRET`` lazily). One function decides, ``use_triton_interpreter``: the interpreter exactly
when CUDA is unavailable, unless ``TRITON_INTERPRET`` is set already. The kernel module calls it before defining its
kernels and ``tests/conftest.py`` before collecting; ``get_backend("triton")`` without CUDA insists on the
interpreter (``enable_triton_interpreter``) and raises only if the module was already imported in compiled mode
(``TRITON_INTERPRET=0`` forced on a CPU). The interpreter is slow (~0.2 ms per Triton op): use it for tests on
small shapes, not for serving.

The interpreter accepts code the real compiler rejects or makes slow, so :mod:`pagedattn.kernels.compile_check`
also compiles every kernel for sm_80 / sm_90 without a GPU (:mod:`pagedattn.kernels.aot`) and checks registers,
spills and shared memory.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable

from pagedattn.kernels import cpu
from pagedattn.kernels.reference import (copy_blocks_ref, paged_attention_ref, plan_decode, reshape_and_cache_ref,
                                         swap_blocks_ref)

__all__ = ["KernelBackend", "get_backend", "available_backends", "enable_triton_interpreter", "use_triton_interpreter",
           "paged_attention_ref", "reshape_and_cache_ref", "copy_blocks_ref", "swap_blocks_ref"]

_TRITON_MODULE = "pagedattn.kernels.paged_attention"
_TRITON_LAYER_MODULE = "pagedattn.kernels.fused_layer"


@dataclass(frozen=True)
class KernelBackend:
    """The four cache operations of one backend (same signatures as the ``*_ref`` functions). ``plan_decode``, where
    set, builds once per decode step what ``paged_attention(..., plan=...)`` would otherwise rebuild in every layer.
    ``rope_and_cache``, where set (Triton), applies RoPE to q and k and writes K/V into the cache in one launch
    (:func:`pagedattn.kernels.fused_layer.rope_and_cache`); a model on a GPU then skips ``reshape_and_cache``."""

    name: str
    paged_attention: Callable
    reshape_and_cache: Callable
    copy_blocks: Callable
    swap_blocks: Callable
    interpreted: bool = False
    plan_decode: Callable | None = None
    rope_and_cache: Callable | None = None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def use_triton_interpreter() -> bool:
    """Whether Triton kernels defined from now on run in the CPU interpreter: the one place that decides. Compiled
    Triton needs CUDA, so without it ``TRITON_INTERPRET=1`` is set, unless the environment chose already
    (``compile_check`` sets 0 to compile for a GPU this machine does not have)."""
    if not _cuda_available() and not os.environ.get("TRITON_INTERPRET"):
        os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def enable_triton_interpreter() -> None:
    """Make Triton kernels defined from now on run in the CPU interpreter (sets ``TRITON_INTERPRET=1``).

    Raises ``RuntimeError`` if the kernel module was already imported in compiled mode: the choice is made at
    definition time and cannot be undone in this process.
    """
    mod = sys.modules.get(_TRITON_MODULE)
    if mod is not None and not getattr(mod, "INTERPRET", False):
        raise RuntimeError("pagedattn.kernels.paged_attention was imported without TRITON_INTERPRET=1; set "
                           "TRITON_INTERPRET=1 in the environment before starting Python to run Triton on a CPU")
    os.environ["TRITON_INTERPRET"] = "1"
    try:  # triton >= 3.4 reads its knobs lazily from the environment; older versions need nothing more
        from triton import knobs

        knobs.runtime.interpret = True
    except Exception:  # pragma: no cover - depends on the triton version
        pass


def available_backends() -> list[str]:
    names = ["torch"]
    if cpu.available():
        names.append("cpu")
    try:
        import triton  # noqa: F401

        names.append("triton")
    except ImportError:  # pragma: no cover
        pass
    return names


def get_backend(name: str | None = "auto") -> KernelBackend:
    """Return the kernel backend ``"torch"``, ``"cpu"``, ``"triton"``, or ``"auto"``/None (triton on CUDA, else cpu
    where its kernel builds, else torch).

    ``"triton"`` without CUDA switches on the interpreter (see the module docstring); its kernels then expect CPU
    tensors.
    """
    name = (name or "auto").lower()
    if name == "auto":
        name = ("triton" if "triton" in available_backends() else "torch") if _cuda_available() else (
            "cpu" if cpu.available() else "torch")
    if name == "cpu":
        if not cpu.available():
            raise RuntimeError("the 'cpu' backend's kernel is not available (no C++ compiler, a failed build, or "
                               "PAGEDATTN_CPU_KERNEL=0; see the warning): use 'torch'")
        return KernelBackend("cpu", cpu.paged_attention_cpu, cpu.reshape_and_cache_cpu, copy_blocks_ref,
                             swap_blocks_ref)
    if name == "torch":
        return KernelBackend("torch", paged_attention_ref, reshape_and_cache_ref, copy_blocks_ref, swap_blocks_ref,
                             plan_decode=plan_decode)
    if name == "triton":
        if not _cuda_available():
            enable_triton_interpreter()
        import importlib

        mod = importlib.import_module(_TRITON_MODULE)
        fused = importlib.import_module(_TRITON_LAYER_MODULE)  # by name, as the kernel module: no import circle
        return KernelBackend("triton", mod.paged_attention, mod.reshape_and_cache, mod.copy_blocks, mod.swap_blocks,
                             interpreted=mod.INTERPRET, rope_and_cache=fused.rope_and_cache)
    raise ValueError(f"unknown kernel backend {name!r}; choose 'torch', 'cpu', 'triton' or 'auto'")
