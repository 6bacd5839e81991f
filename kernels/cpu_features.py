"""What this CPU computes natively: read once from ``/proc/cpuinfo`` (torch's own probes where that
file is absent), so the dtype choice and the native kernels' ISA dispatch agree on one answer.

The same install runs on different machines (an AVX2 EPYC today, an AMX Xeon tomorrow), so none of
this may be baked in at build time: it is asked at run time, every start.

``set_isa_cap`` lowers the level for the whole process (tests, A/B runs; llmctl sets it from its
configuration): ``isa_level`` and ``native_bf16_units`` honour it, and the native kernels already
loaded switch to the capped variant at once.
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Callable
from functools import lru_cache

# Kernel variants compiled into kernels/cpu/cpu_kernels.cpp, best first, with the flags each needs.
ISA_LEVELS: dict[str, frozenset[str]] = {
    "avx512bf16": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "generic": frozenset(),
}
_isa_cap: str | None = None  # set_isa_cap's level: the highest variant any kernel may use
_cap_listeners: list[Callable[[], None]] = []  # loaded native modules re-selecting their variant
_cap_lock = threading.Lock()


def set_isa_cap(cap: str | None) -> None:
    """Cap the kernel variants at ``cap`` (a key of ``ISA_LEVELS``; it may only lower the CPU's own
    level), or lift the cap (None). Applied at once to the native kernels already loaded."""
    global _isa_cap
    if cap is not None and cap not in ISA_LEVELS:
        raise ValueError(f"ISA cap {cap!r}: choose one of {', '.join(ISA_LEVELS)}")
    with _cap_lock:
        _isa_cap = cap
        listeners = list(_cap_listeners)
    for reselect in listeners:
        reselect()


def isa_cap() -> str | None:
    return _isa_cap


def on_isa_cap_change(reselect: Callable[[], None]) -> None:
    """Call ``reselect`` whenever the cap changes (a native module re-selecting its variant)."""
    with _cap_lock:
        _cap_listeners.append(reselect)


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
    where ``set_isa_cap`` lowers the kernels below ``avx512bf16``: the dtype choice then follows the
    CPU the kernels act as, not one they no longer use."""
    flags = cpu_flags() if flags is None else flags
    if _isa_cap is not None and isa_level(flags) != "avx512bf16":
        return []
    return [name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]


def isa_level(flags: frozenset[str] | None = None) -> str:
    """The best kernel variant this CPU runs; ``set_isa_cap`` may only lower it (tests, A/B runs)."""
    supported = supported_isa_levels(flags)
    if _isa_cap is not None and _isa_cap in supported:
        return _isa_cap
    return supported[0]


def supported_isa_levels(flags: frozenset[str] | None = None) -> list[str]:
    flags = cpu_flags() if flags is None else flags
    return [level for level, needs in ISA_LEVELS.items() if needs <= flags]
