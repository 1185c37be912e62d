"""Ahead-of-time compilation of one kernel launch for a GPU that is not there (§5.1's kernels, checked on a CPU).

``triton.compile`` with an explicit ``GPUTarget("cuda", 80 | 90, 32)`` runs the whole pipeline (TTIR -> TTGIR ->
LLVM IR -> PTX -> cubin) with the ``ptxas`` shipped in the triton wheel; no GPU and no CUDA driver are needed.
``ptxas -v`` reports registers, spills and stack; Triton's metadata gives shared memory, warps and stages.

COMPILER INTERNALS: this is the only module that touches them, so that a Triton upgrade breaks one place. It relies
on (all present and identical in Triton 3.6 and 3.9): ``triton.compiler.ASTSource(fn, signature, constexprs,
attrs)``; ``triton._C.libtriton.native_specialize_impl``, the JIT's own argument specialisation (pointer and integer
types, ints equal to 1 become constexprs, 16-divisible ints and 16-aligned pointers get ``tt.divisibility``);
``CUDABackend.parse_attr``; ``knobs.compilation.always_compile``; ``knobs.nvidia.dump_ptxas_log``, which makes
the NVIDIA backend *print* the ptxas log (the ``n_regs`` / ``n_spills`` of a ``CompiledKernel`` come from the
driver when the binary is loaded, so without a GPU the log is the only source); and
``CompiledKernel.metadata.{shared,num_warps,num_stages}``.

It must run in a process whose kernels were defined *compiled*, not interpreted (``TRITON_INTERPRET=0`` before
:mod:`pagedattn.kernels.paged_attention` is imported; Triton's own library functions such as ``tl.sum``'s combine
function are also defined interpreted otherwise): :mod:`pagedattn.kernels.compile_check` runs it in a subprocess.
"""
from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass

#: per-block shared memory limits (opt-in maximum) and the register file per SM, from the CUDA programming guide's
#: compute-capability table: sm_80 (A100) 163 KB, sm_90 (H100) 227 KB; 64K 32-bit registers per SM; at most 255
#: registers per thread
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
REGISTER_FILE = 65536
MAX_REGS_PER_THREAD = 255


@dataclass(frozen=True)
class CompileStats:
    """What one compile of one kernel variant reports."""

    kernel: str
    arch: int
    registers: int
    spill_stores: int  # bytes per thread
    spill_loads: int
    stack_frame: int
    shared: int  # bytes per block
    num_warps: int
    num_stages: int

    @property
    def threads(self) -> int:
        return 32 * self.num_warps


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
}


def parse_ptxas_log(log: str) -> dict[str, int]:
    """Registers, spill bytes and stack frame from a ``ptxas -v`` log (one entry function)."""
    out = {}
    for key, pat in _PTXAS.items():
        m = pat.search(log)
        if m is None:
            if key == "registers":
                raise ValueError(f"no register count in the ptxas log:\n{log}")
            out[key] = 0
        else:
            out[key] = int(m.group(1))
    return out


def jit_function(kernel):
    """The ``JITFunction`` behind ``kernel`` (which is interpreted if it was defined under ``TRITON_INTERPRET=1``)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    raise RuntimeError(f"{getattr(kernel, '__name__', kernel)} was defined under Triton's interpreter; compile it in a "
                       "process started with TRITON_INTERPRET=0 (pagedattn.kernels.compile_check does)")


def source(kernel, args: tuple, constexprs: dict):
    """``ASTSource`` for ``kernel(*args, **constexprs)``, specialised as the JIT specialises a real launch."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    fn = jit_function(kernel)
    names = [n for n in fn.arg_names if n not in constexprs]
    if len(names) != len(args):
        raise ValueError(f"{fn.__name__}: {len(args)} positional arguments for {len(names)} parameters {names}")
    signature, consts, attrs = {}, dict(constexprs), {}
    for name, arg in zip(names, args):
        ty, spec = native_specialize_impl(CUDABackend, arg, False, True, True)
        signature[name] = ty
        if ty == "constexpr":
            consts[name] = spec
        elif spec:
            attrs[(fn.arg_names.index(name),)] = CUDABackend.parse_attr(spec)
    for name in constexprs:
        signature[name] = "constexpr"
    signature = {n: signature[n] for n in fn.arg_names}
    return ASTSource(fn, signature, consts, attrs)


def _compile(kernel, args: tuple, constexprs: dict, num_warps: int, num_stages: int, arch: int,
             enable_fp_fusion: bool = True):
    """``(CompiledKernel, ptxas log, name)`` of one launch compiled for ``sm_<arch>``."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    src = source(kernel, args, constexprs)
    log = io.StringIO()
    prev = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True  # a cache hit would skip ptxas, and with it the log
    try:
        with contextlib.redirect_stdout(log):
            ck = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages,
                                             enable_fp_fusion=enable_fp_fusion))
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = prev
    return ck, log.getvalue(), src.name


def compile_launch(kernel, args: tuple, constexprs: dict, num_warps: int, num_stages: int, arch: int,
                   enable_fp_fusion: bool = True) -> CompileStats:
    """Compile one launch for ``sm_<arch>`` and return its resource use. Raises whatever the compiler raises."""
    ck, log, name = _compile(kernel, args, constexprs, num_warps, num_stages, arch, enable_fp_fusion)
    md = ck.metadata
    return CompileStats(kernel=name, arch=arch, shared=int(md.shared), num_warps=int(md.num_warps),
                        num_stages=int(md.num_stages), **parse_ptxas_log(log))


def launch_ptx(launch, arch: int) -> str:
    """The PTX of a :class:`~pagedattn.kernels.paged_attention.Launch` for ``sm_<arch>`` (its options included)."""
    return _compile(launch.kernel, launch.args, launch.constexprs, launch.num_warps, launch.num_stages, arch,
                    launch.fp_fusion)[0].asm["ptx"]
