"""The host CPU as Linux's ``/proc/cpuinfo`` describes it: its name and its feature flags.

Two readers need them: the C++ kernels' build cache (``-march=native`` code depends on the flags) and the results'
hardware label (machines of one name here differ by their vector extensions, and CPU timings with them)."""
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
