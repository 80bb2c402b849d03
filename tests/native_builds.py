"""The builds of the native kernels (``-march``, ``native.build.Kernel.arch``) that the kernel tests check on
this machine, each against torch: this CPU's own (``native``) and every portable path it can also run.

* ``x86-64-v4``: AVX-512 without its BF16 extension (the ``avx512`` paths: bfloat16 widened to float32),
  where this CPU has AVX-512 and BF16 (else ``native`` is that build already, or cannot run it);
* ``x86-64-v3``: AVX2 + FMA (the ``avx2`` paths), where the CPU has them;
* ``x86-64``: the baseline ISA (the ``portable`` loops), on any x86-64.

On another machine (aarch64, say) only ``native``.  A build this CPU cannot execute is not listed: that is
not a skip of an installable thing, the code would fault.
"""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``), empty where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def archs() -> tuple[str, ...]:
    """The ``-march`` values to build and test here, ``native`` first."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ("native",)
    flags = cpu_flags()
    out = ["native"]
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16"} <= flags:
        out.append("x86-64-v4")
    if {"avx2", "fma", "f16c", "bmi2", "movbe"} <= flags:
        out.append("x86-64-v3")
    out.append("x86-64")
    return tuple(out)


# The ISA string each portable build reports (``mechserve_linear_isa``).
ISA = {"x86-64-v4": b"avx512", "x86-64-v3": b"avx2", "x86-64": b"portable"}
ARCHS = archs()

__all__ = ["ARCHS", "ISA", "archs", "cpu_flags"]
