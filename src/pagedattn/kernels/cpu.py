"""The CPU decode kernels: paged attention that reads K/V in place in the cache (§4.1, Fig. 5), the KV-cache write,
and the small per-layer operations around them (RMSNorm with the residual add, RoPE, greedy argmax), in C++.

In eager torch, a paged decode step must first copy each sequence's blocks out of the cache (``index_select``)
before ``scaled_dot_product_attention`` can read them, so the K/V bytes cross memory three times and every bucket
of sequences costs a dozen torch calls (:mod:`pagedattn.kernels.reference`). ``cpu_attention.cpp`` walks each block
table instead, as vLLM's CUDA kernel does, and reads every K and V row once; it needs no decode plan. The cache write
is one call too (a torch write is about nine small torch calls per layer). Both run on one thread, unless
:func:`set_threads` (the engine's ``threads`` option) splits the attention's batch over more.

The per-layer operations (``cpu_layer_ops.cpp``) replace torch calls whose fixed cost dominates at decode shapes:
at batch 64, torch's RMSNorm took 35-80 us per call on ``[64, 256]`` and ``max(dim)`` about 300 us on the
``[64, 8192]`` logits. Each keeps the reference's arithmetic: RoPE is bit-identical to
:func:`pagedattn.model.llama.apply_rope`; RMSNorm and argmax follow transformers' formula and torch's tie rule.

The sources are compiled on first use with the system's C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``) into
``$PAGEDATTN_CACHE_DIR`` (default ``$XDG_CACHE_HOME/pagedattn``, else ``~/.cache/pagedattn``), keyed by a hash of the
source, compiler and flags (a new build removes the older ones), and loaded with ``ctypes``: no torch headers, so it
builds in about a second and does not depend on the torch version. The ctypes signatures are declared here
(``_SIGNATURES``); the library exports ``pagedattn_abi_version()``, and a library whose version is not
``ABI_VERSION`` is refused at load.
Without a compiler, or with ``PAGEDATTN_CPU_KERNEL=0``, :func:`available` is False and ``get_backend("auto")`` falls
back to the torch reference. :func:`paged_attention_cpu` itself falls back to the reference for inputs the kernel
does not take (not on the CPU, fp16, a non-contiguous cache, a query that needs gradients).

bf16 (§4.1's kernel over a bf16 KV cache): K/V, query and output stay in bf16, the arithmetic is fp32. Reading a
bf16 is a shift (bf16 is the upper half of an fp32), which the compiler vectorises on any CPU; writing one rounds to
nearest even. Which instructions run is chosen when the library is built, not by a run-time branch: it is built with
``-march=native`` and keyed by the CPU's feature flags, so on a CPU with AVX512_BF16 ``__AVX512BF16__`` is defined
and the q.k dot products use ``VDPBF16PS``; elsewhere (or with a compiler that rejects ``-march=native``) the
portable path is compiled (tests/test_kernels.py builds and checks both). RMSNorm and RoPE take bf16 too, rounding
to bf16 wherever the torch ops they replace round (each torch op on bf16 computes in fp32 and rounds its result
once), so they stay bit-identical to transformers; argmax stays fp32 (the sampler's logits are). The linear layers
stay in torch, whose bf16 matmul goes through oneDNN (``torch.backends.mkldnn``).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
import warnings
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from pagedattn.cpuinfo import cpu_flags
from pagedattn.kernels.reference import paged_attention_ref, reshape_and_cache_ref

__all__ = ["available", "paged_attention_cpu", "reshape_and_cache_cpu", "load_library", "takes", "rms_norm_cpu",
           "rope_cpu", "argmax_cpu"]

FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math"]
# Each source with its own arithmetic flags. The attention kernel's dot products and sums may vectorise as trees
# (-fassociative-math and the flag it needs): summation order is not part of its contract (the tests compare against
# float64 with a tolerance). The per-layer operations must round exactly as torch does (no reassociation, no FMA
# contraction). No -ffinite-math-only anywhere: the kernels must stay correct around NaN-holding slots they do not
# read.
SOURCES = {Path(__file__).with_name("cpu_attention.cpp"): ["-fassociative-math", "-fno-signed-zeros", "-fopenmp"],
           Path(__file__).with_name("cpu_layer_ops.cpp"): ["-ffp-contract=off"]}
# about 20 % faster where it is accepted (AVX2/AVX-512; 512-bit vectors where the CPU has them); the library is keyed
# by the CPU
NATIVE = ["-march=native", "-mprefer-vector-width=512"]
#: headers the sources include (part of the build key)
HEADERS = [Path(__file__).with_name("bf16.h")]
_FUNCTIONS = {torch.float32: "paged_attention_f32", torch.float64: "paged_attention_f64",
              torch.bfloat16: "paged_attention_bf16"}
#: (dtype of the new K/V rows, dtype of the cache) -> the write that takes them
_WRITES = {(torch.float32, torch.float32): "reshape_and_cache_f32",
           (torch.float64, torch.float64): "reshape_and_cache_f64",
           (torch.bfloat16, torch.bfloat16): "reshape_and_cache_bf16",
           (torch.float32, torch.bfloat16): "reshape_and_cache_f32_bf16"}
_ERRORS = {1: "a block table entry inside a context is not a block of the cache",
           2: "a context is longer than its block table (max_blocks * block_size)"}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the machine and its CPU's feature flags (a cache directory may be shared
    between machines)."""
    return f"{platform.machine()} {platform.processor()} {cpu_flags()}"


def _build(cxx: str, native: list[str], out: str) -> None:
    """Compile each source with its flags and link them into the shared library ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        objects = []
        for i, (src, extra) in enumerate(SOURCES.items()):
            objects.append(f"{tmp}/{i}.o")
            subprocess.run([cxx, *FLAGS, *native, *extra, "-c", str(src), "-o", objects[-1]], check=True,
                           capture_output=True, text=True)
        subprocess.run([cxx, "-shared", "-fopenmp", *objects, "-o", out], check=True, capture_output=True, text=True)


@lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel (built once per source, compiler and flags), or None with a warning saying why."""
    if os.environ.get("PAGEDATTN_CPU_KERNEL", "1") == "0":
        return None
    cxx = _compiler()
    if cxx is None:
        warnings.warn("no C++ compiler found ($CXX, c++, g++, clang++): the CPU decode kernel is off, decode "
                      "attention uses the torch reference", RuntimeWarning, stacklevel=2)
        return None
    key = hashlib.sha256(repr([[(f.read_text(), x) for f, x in SOURCES.items()], [h.read_text() for h in HEADERS],
                               cxx, FLAGS, NATIVE, _cpu_id()]).encode()).hexdigest()[:16]
    cache = cache_dir()
    lib = cache / f"cpu_attention_{key}.so"
    try:
        if not lib.exists():
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
            try:
                try:
                    _build(cxx, NATIVE, tmp)
                except subprocess.CalledProcessError:  # a compiler without -march=native: the portable build
                    _build(cxx, [], tmp)
                os.replace(tmp, lib)  # atomic: concurrent builders never load a half-written library
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            prune(cache, keep=lib)
        dll = ctypes.CDLL(str(lib))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(f"the CPU decode kernel did not build ({detail.strip()[:500]}): decode attention uses the "
                      "torch reference", RuntimeWarning, stacklevel=2)
        return None
    problem = bind(dll)
    if problem:
        warnings.warn(f"the CPU decode kernel at {lib} is not the one this code expects ({problem}): decode "
                      "attention uses the torch reference", RuntimeWarning, stacklevel=2)
        return None
    return dll


def _shares_name(name: str) -> str:
    """The exported function that runs ``name`` (``paged_attention_<dtype>``) over shares of the batch at once."""
    return name.replace("paged_attention_", "paged_attention_shares_")


#: The version of the exported signatures below; ``pagedattn_abi_version()`` in ``cpu_attention.cpp`` must return it.
ABI_VERSION = 5
_I64, _PTR, _F64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
#: name -> (argument types, return type) of every function the library exports
_SIGNATURES = {**{name: ([_PTR] * 6 + [_I64] * 8 + [_F64], ctypes.c_int) for name in _FUNCTIONS.values()},
               **{_shares_name(name): ([_PTR] * 6 + [_I64] * 7 + [_F64, _PTR, _I64], ctypes.c_int)
                  for name in _FUNCTIONS.values()},
               **{name: ([_PTR] * 5 + [_I64] * 5, ctypes.c_int) for name in _WRITES.values()},
               **{f"rms_norm_{s}": ([_PTR] * 4 + [_I64] * 2 + [_F64], None) for s in ("f32", "bf16")},
               **{f"rope_{s}": ([_PTR] * 3 + [_I64] * 4, None) for s in ("f32", "bf16")},
               **{f"argmax_rows_{s}": ([_PTR, _I64, _I64, _PTR], None) for s in ("f32", "bf16")}}


def bind(dll: ctypes.CDLL) -> str | None:
    """Declare the ctypes signatures of ``dll``'s functions; a reason to refuse it (another ABI version, a missing
    function), or None."""
    try:
        version = dll.pagedattn_abi_version
    except AttributeError:
        return "it exports no pagedattn_abi_version()"
    version.argtypes, version.restype = [], ctypes.c_int
    if version() != ABI_VERSION:
        return f"ABI version {version()}, expected {ABI_VERSION}"
    for name, (args, ret) in _SIGNATURES.items():
        try:
            fn = getattr(dll, name)
        except AttributeError:
            return f"it exports no {name}()"
        fn.argtypes, fn.restype = args, ret
    return None


def cache_dir() -> Path:
    """Where compiled libraries live: ``$PAGEDATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedattn``, else
    ``~/.cache/pagedattn``."""
    if os.environ.get("PAGEDATTN_CACHE_DIR"):
        return Path(os.environ["PAGEDATTN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedattn"


def prune(cache: Path, keep: Path, max_age_s: float = 3600.0) -> list[Path]:
    """Remove older builds from ``cache`` (``cpu_attention_*.so`` other than ``keep``, unused for ``max_age_s``:
    another checkout sharing the folder may still be using a recent one). Returns what was removed."""
    removed = []
    now = time.time()
    for old in cache.glob("cpu_attention_*.so"):
        try:
            st = old.stat()
            if old != keep and now - max(st.st_atime, st.st_mtime) > max_age_s:
                old.unlink()
                removed.append(old)
        except OSError:
            pass
    return removed


def available() -> bool:
    """True when the kernel is built (or builds now) and is not switched off."""
    return load_library() is not None


_threads = 1


def set_threads(n: int) -> None:
    """Threads for :func:`paged_attention_cpu` (process-wide, as ``torch.set_num_threads``; default 1, which the
    benchmarks and notebooks keep): with ``n > 1`` a batch's sequences are split into ``n`` shares of about equal
    context and the shares run at once in one C++ call, one OpenMP thread each (torch's intra-op threads, see
    ``cpu_attention.cpp``; a pool of Python threads, each making its own ctypes call, gained nothing on the 2-core VM
    at two threads: torch's threads spin between its operations and held the second core). The engine's ``threads``
    option sets it."""
    global _threads
    if n < 1:
        raise ValueError(f"threads={n}: at least one thread")
    _threads = n


def _shares(lens: Tensor, n: int) -> list[tuple[int, int]]:
    """``n`` (or fewer) ranges of consecutive sequences, cut where the running sum of context lengths crosses each
    ``i / n`` of the total."""
    total = lens.to(torch.int64).cumsum(0)
    cuts = torch.searchsorted(total, total[-1] * torch.arange(1, n, dtype=torch.int64) // n, right=True).tolist()
    bounds = sorted({0, *cuts, len(lens)})
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def paged_attention_cpu(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                        context_lens: Tensor, scale: float, plan=None) -> Tensor:
    """:func:`pagedattn.kernels.reference.paged_attention_ref`'s contract (same arguments, same result; ``plan`` is
    accepted and unused), computed in place over the cache by ``cpu_attention.cpp`` for fp32/fp64/bf16 CPU tensors
    (bf16: query, cache and output in bf16, scores, softmax and sums in fp32, the output rounded to nearest even).

    Raises ``ValueError`` when a block table entry inside a context is not a block of the cache, or a context is
    longer than its table row (nothing outside the cache or the table is read). With :func:`set_threads` above 1,
    shares of the batch run on that many threads, with the same result bit for bit (each sequence is computed
    alone).
    """
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    dll = load_library()
    name = _FUNCTIONS.get(query.dtype)
    if (dll is None or name is None or not query.is_cpu or key_cache.dtype != query.dtype
            or value_cache.dtype != query.dtype or not (key_cache.is_contiguous() and value_cache.is_contiguous())
            or key_cache.shape != value_cache.shape or (query.requires_grad and torch.is_grad_enabled())):
        return paged_attention_ref(query, key_cache, value_cache, block_tables, context_lens, scale, plan)
    # rows of heads may be apart (q as a view of a fused q|k|v), each head's values must be contiguous
    q = query if query.stride(2) == 1 and query.stride(1) == head_dim else query.contiguous()
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    lens = context_lens if context_lens.dtype == torch.int32 else context_lens.to(torch.int32)
    tables, lens = tables.contiguous(), lens.contiguous()
    if tables.dim() != 2 or tables.shape[0] != num_seqs or lens.shape != (num_seqs,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} do "
                         f"not match {num_seqs} sequences")
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=query.dtype)
    fn, esize, width = getattr(dll, name), query.element_size(), tables.shape[1]

    def run(first: int, end: int) -> int:  # sequences first .. end - 1
        return fn(q.data_ptr() + first * q.stride(0) * esize, key_cache.data_ptr(), value_cache.data_ptr(),
                  tables.data_ptr() + first * width * 4, lens.data_ptr() + first * 4,
                  out.data_ptr() + first * num_heads * head_dim * esize, end - first, num_heads, num_kv_heads,
                  head_dim, block_size, num_blocks, width, q.stride(0), float(scale))
    shares = _shares(lens, min(_threads, num_seqs)) if _threads > 1 and num_seqs > 1 else []
    if len(shares) > 1:  # one OpenMP thread per share (torch's intra-op threads: see cpu_attention.cpp)
        bounds = torch.tensor([a for a, _ in shares] + [num_seqs], dtype=torch.int64)
        rc = getattr(dll, _shares_name(name))(
            q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            out.data_ptr(), num_heads, num_kv_heads, head_dim, block_size, num_blocks, width, q.stride(0),
            float(scale), bounds.data_ptr(), len(shares))
    else:
        rc = run(0, num_seqs)
    if rc:
        raise ValueError(f"paged_attention_cpu: {_ERRORS[rc]} (num_blocks={num_blocks}, block_size={block_size}, "
                         f"max context {int(lens.max())}, table width {tables.shape[1]})")
    return out


def _rows(x: Tensor, num_tokens: int, row: int) -> int | None:
    """Elements between the tokens of ``x`` ``[T, heads, head_dim]`` when each token's heads are one contiguous row
    of ``row`` elements (also a view of a fused q|k|v), else None."""
    if x.dim() != 3 or x.shape[0] != num_tokens or x.shape[1] * x.shape[2] != row:
        return None
    return x.stride(0) if x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2]) else None


def reshape_and_cache_cpu(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                          slot_mapping: Tensor) -> None:
    """:func:`pagedattn.kernels.reference.reshape_and_cache_ref` in one C++ call (one row copy per token and cache;
    a negative slot is a padding token and is skipped), for fp32/fp64/bf16 CPU tensors, and fp32 rows into a bf16 cache
    (rounded to nearest even, bit for bit as ``.to(torch.bfloat16)``); the reference otherwise.

    Raises ``ValueError`` when a slot is past the cache, before anything is written.
    """
    dll = load_library()
    name = _WRITES.get((key.dtype, key_cache.dtype))
    num_tokens, row = key.shape[0], key_cache.shape[2] * key_cache.shape[3]
    ks, vs = _rows(key, num_tokens, row), _rows(value, num_tokens, row)
    if (dll is None or name is None or key.device.type != "cpu" or ks is None or vs is None
            or key.dtype != value.dtype or key_cache.dtype != value_cache.dtype
            or not (key_cache.is_contiguous() and value_cache.is_contiguous())
            or key_cache.shape != value_cache.shape or slot_mapping.device.type != "cpu"
            or (torch.is_grad_enabled() and (key.requires_grad or value.requires_grad))):
        return reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping)
    slots = (slot_mapping if slot_mapping.dtype == torch.long else slot_mapping.to(torch.long)).contiguous()
    if slots.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} does not match {num_tokens} tokens")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if getattr(dll, name)(key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                          slots.data_ptr(), num_tokens, row, num_slots, ks, vs):
        raise ValueError(f"reshape_and_cache_cpu: a slot is past the cache ({num_slots} slots, largest slot "
                         f"{int(slots.max())})")


# ------------------------------------------------------------------------------------------ per-layer operations
#: the dtypes of :func:`rms_norm_cpu` and :func:`rope_cpu`, by the suffix of their C++ functions
LAYER_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


@lru_cache(maxsize=None)
def layer_function(name: str, dtype: torch.dtype):
    """The C++ function ``<name>_<f32|bf16>`` for ``dtype`` (``LAYER_DTYPES``), looked up once: the per-layer
    operations run about 15 times per decode step."""
    return getattr(load_library(), f"{name}_{LAYER_DTYPES[dtype]}")


def takes(*xs: Tensor, dtypes=(torch.float32,)) -> bool:
    """Whether the per-layer operations below run in C++ for these tensors (all of one dtype in ``dtypes``: fp32,
    also bf16 for RMSNorm and RoPE; on the CPU, no gradient wanted, the library built); callers fall back to their
    torch lines otherwise."""
    if load_library() is None or xs[0].dtype not in dtypes:
        return False
    grad = torch.is_grad_enabled()
    for x in xs:  # a plain loop: this runs about 15 times per decode step
        if x.dtype is not xs[0].dtype or not x.is_cpu or (grad and x.requires_grad):
            return False
    return True


def rms_norm_cpu(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """``weight * (h * rsqrt(mean(h^2) + eps))`` over the last dimension, with ``h = x`` or, given ``residual``,
    ``h = x + residual``, which is also written into ``residual`` (the decoder layer's residual add, fused).
    ``x`` and ``residual`` are contiguous ``[..., dim]`` fp32 or bf16 CPU tensors (see :func:`takes`); in bf16 the
    statistics are fp32 and each step rounds to bf16 where transformers' ``LlamaRMSNorm`` does, bit for bit."""
    dim = x.shape[-1]
    if not x.is_contiguous() or weight.shape != (dim,) or (residual is not None and (
            residual.shape != x.shape or not residual.is_contiguous())):
        raise ValueError(f"rms_norm_cpu: x {tuple(x.shape)}, weight {tuple(weight.shape)} and residual "
                         f"{None if residual is None else tuple(residual.shape)} must be contiguous [..., {dim}]")
    out = torch.empty_like(x)
    fn = layer_function("rms_norm", x.dtype)
    fn(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.contiguous().data_ptr(),
       out.data_ptr(), x.numel() // dim, dim, float(eps))
    return out


def rope_cpu(x: Tensor, cos: Tensor, sin_rot: Tensor) -> Tensor:
    """:func:`pagedattn.model.llama.apply_rope` in place on ``x`` ``[T, heads, head_dim]`` (each token's heads one
    contiguous row, as in a view of a fused q|k|v), bit for bit in fp32 and bf16; ``cos``/``sin_rot``
    ``[T, 1, head_dim]``. Returns ``x``."""
    T, heads, head_dim = x.shape
    if (_rows(x, T, heads * head_dim) is None or head_dim % 2 or cos.shape != (T, 1, head_dim)
            or sin_rot.shape != cos.shape):
        raise ValueError(f"rope_cpu: x {tuple(x.shape)} (strides {x.stride()}), cos {tuple(cos.shape)}, sin "
                         f"{tuple(sin_rot.shape)} do not fit")
    fn = layer_function("rope", x.dtype)
    fn(x.data_ptr(), cos.contiguous().data_ptr(), sin_rot.contiguous().data_ptr(), T, heads, head_dim, x.stride(0))
    return x


def argmax_cpu(logits: Tensor) -> Tensor:
    """``logits.max(dim=-1).indices`` for a ``[rows, vocab]`` fp32 or bf16 CPU tensor (``LAYER_DTYPES``): the first
    maximum of each row, a NaN counting as the maximum. bf16 logits are compared as they are (their fp32 values are
    exact), which saves the step the copy of its logits to fp32."""
    rows, cols = logits.shape
    if cols == 0:
        raise ValueError("argmax_cpu: a row of logits is empty (vocabulary of size 0)")
    x = logits.contiguous()
    out = torch.empty(rows, dtype=torch.long)
    if rows:
        lib = load_library()
        if lib is None:
            raise RuntimeError("argmax_cpu: the C++ kernel is not built (see the warning above)")
        layer_function("argmax_rows", x.dtype)(x.data_ptr(), rows, cols, out.data_ptr())
    return out
