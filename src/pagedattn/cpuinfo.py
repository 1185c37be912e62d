"""The host CPU as Linux's ``/proc/cpuinfo`` describes it: its name and its feature flags.

Four readers need them: the C++ kernels' build cache (``-march=native`` code depends on the flags), the results'
hardware label (machines of one name here differ by their vector extensions, and CPU timings with them), the
engine's bf16 warning (``bf16_in_hardware``) and the fp32 linear layers' choice of library (``intel_cpu``)."""
from __future__ import annotations

from pathlib import Path


def cpu_field(*keys: str) -> str:
    """The value of the first ``/proc/cpuinfo`` line that starts with one of ``keys``; ``""`` where there is none
    (or no such file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> str:
    """The CPU's feature flags, space-separated (``flags`` on x86, ``Features`` on Arm)."""
    return cpu_field("flags", "Features")


def bf16_in_hardware(flags: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX or AVX-512 BF16, from its feature flags, or ``flags``).
    Elsewhere torch's bf16 matmuls are emulated: on an AVX2-only VM our engine ran 28x slower in bf16 than in fp32
    (``results/benchmarks/engine_vs_vllm_avx2.json``)."""
    have = set((cpu_flags() if flags is None else flags).split())
    return bool(have & {"amx_bf16", "avx512_bf16"})


def intel_cpu(vendor: str | None = None) -> bool:
    """Whether this CPU (or ``vendor``, a ``vendor_id``) is Intel's, where MKL's fp32 GEMM is the faster one at a
    decode step's sizes (``pagedattn.model.fused``)."""
    return (cpu_field("vendor_id") if vendor is None else vendor) == "GenuineIntel"
