"""The native fp32 panel GEMM (C++ in kernels/cpu/gemm_kernels.cpp; torch reference in
kernels/fp32_linear.py), built once by the shared builder (``kernels/native_build.py``).

A module of its own so that it builds alone. Optional: without a C++ compiler, or with
``LLMCTL_NATIVE_CPU_KERNELS=0`` or ``LLMCTL_NATIVE_GEMM=0``, fp32 linear layers keep torch's GEMM.
The ISA variant (generic, AVX2+FMA, AVX-512) is chosen at run time from ``kernels.cpu_features``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import ModuleType

import torch

from kernels.cpu_features import isa_level
from kernels.native_build import FAILURES, build_extension, unavailable_reason

NAME = "llmctl_gemm"
SOURCE = Path(__file__).parent / "cpu" / "gemm_kernels.cpp"
HEADERS = [Path(__file__).parent / "cpu" / name for name in ("gemm_kernels.h", "gemm_kernels_isa.h")]
# -ffp-contract=off: only the explicit FMAs fuse, so every variant (the scalar one included) does the
# same arithmetic. -fopenmp: at::parallel_for is inline OpenMP on torch's own libgomp.
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def native_unavailable_reason() -> str | None:
    for variable in ("LLMCTL_NATIVE_CPU_KERNELS", "LLMCTL_NATIVE_GEMM"):
        if os.environ.get(variable, "1") == "0":
            return f"disabled by {variable}=0"
    return unavailable_reason() or FAILURES.get(NAME)


def load_gemm_native() -> ModuleType | None:
    """The compiled module with the best ISA variant selected, building it on first call; None
    (the reason said once on stderr) when it cannot be had here."""
    global _module, _tried
    with _lock:
        if _module is None and not _tried and native_unavailable_reason() is None:
            _tried = True
            _module = build_extension(NAME, [SOURCE], CFLAGS, LDFLAGS, headers=HEADERS)
            if _module is not None:
                _module.set_isa(isa_level())
        return _module


def fp32_linear_native(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same signature and result as ``fp32_linear_torch`` (up to fp32 summation order)."""
    module = load_gemm_native()
    if module is None:
        raise RuntimeError(native_unavailable_reason() or "native fp32 GEMM unavailable")
    return module.linear(x, packed, out_features, bias)
