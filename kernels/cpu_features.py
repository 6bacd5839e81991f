"""What this CPU computes natively: read once from ``/proc/cpuinfo`` (torch's own probes where that
file is absent), so the dtype choice and the native kernels' ISA dispatch agree on one answer.

The same install runs on different machines (an AVX2 EPYC today, an AMX Xeon tomorrow), so none of
this may be baked in at build time: it is asked at run time, every start.
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache

# Kernel variants compiled into kernels/cpu/cpu_kernels.cpp, best first, with the flags each needs.
ISA_LEVELS: dict[str, frozenset[str]] = {
    "avx512bf16": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "generic": frozenset(),
}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The ``flags`` line of /proc/cpuinfo (Linux); elsewhere what torch can tell."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
        if line:
            return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    import torch

    flags: set[str] = set()
    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    if capability.startswith(("AVX2", "AVX512")):
        flags |= {"avx2", "fma", "f16c"}
    if capability.startswith("AVX512"):
        flags |= {"avx512f", "avx512bw", "avx512vl"}
    if torch.cpu._is_avx512_bf16_supported():
        flags.add("avx512_bf16")
    if torch.cpu._is_amx_tile_supported():
        flags |= {"amx_tile", "amx_bf16"}
    return frozenset(flags)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("model name")), "")
        if line:
            return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def native_bf16_units(flags: frozenset[str] | None = None) -> list[str]:
    """The bf16 arithmetic units present (AMX tiles, AVX512-BF16 dot products); empty when bf16 is
    only emulated (converted to fp32 and back), which makes it slower than fp32 on a CPU. Also empty
    where ``LLMCTL_CPU_ISA`` lowers the kernels below ``avx512bf16``: the dtype choice then follows
    the CPU the kernels act as, not one they no longer use."""
    flags = cpu_flags() if flags is None else flags
    if os.environ.get("LLMCTL_CPU_ISA") and isa_level(flags) != "avx512bf16":
        return []
    return [name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]


def isa_level(flags: frozenset[str] | None = None) -> str:
    """The best kernel variant this CPU runs; ``LLMCTL_CPU_ISA`` may only lower it (tests, A/B runs)."""
    flags = cpu_flags() if flags is None else flags
    supported = [level for level, needs in ISA_LEVELS.items() if needs <= flags]
    forced = os.environ.get("LLMCTL_CPU_ISA")
    if forced:
        if forced not in ISA_LEVELS:
            raise ValueError(f"LLMCTL_CPU_ISA={forced!r}: choose one of {', '.join(ISA_LEVELS)}")
        if forced in supported:
            return forced
    return supported[0]


def supported_isa_levels(flags: frozenset[str] | None = None) -> list[str]:
    flags = cpu_flags() if flags is None else flags
    return [level for level, needs in ISA_LEVELS.items() if needs <= flags]
