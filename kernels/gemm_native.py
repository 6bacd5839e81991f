"""The native fp32 panel GEMM (C++ in kernels/cpu/gemm_kernels.cpp; torch reference in
kernels/fp32_linear.py), built once by the shared builder (``kernels/native_build.py``).

A module of its own so that it builds alone. Optional: without a C++ compiler, or with
``LLMCTL_NATIVE_CPU_KERNELS=0`` or ``LLMCTL_NATIVE_GEMM=0``, fp32 linear layers keep torch's GEMM.
The ISA variant (generic, AVX2+FMA, AVX-512) is chosen at run time from ``llmctl_kernels.cpu_features``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmctl_kernels.cpu_features import isa_level
from llmctl_kernels.native_build import LazyExtension, disabled_by

NAME = "llmctl_gemm"
SOURCE = Path(__file__).parent / "cpu" / "gemm_kernels.cpp"
HEADERS = [Path(__file__).parent / "cpu" / name for name in ("gemm_kernels.h", "gemm_kernels_isa.h")]
# -ffp-contract=off: only the explicit FMAs fuse, so every variant (the scalar one included) does the
# same arithmetic. -fopenmp: at::parallel_for is inline OpenMP on torch's own libgomp.
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]
EXTENSION = LazyExtension(NAME, [SOURCE], CFLAGS, LDFLAGS, headers=HEADERS,
                          precondition=lambda: disabled_by("LLMCTL_NATIVE_CPU_KERNELS", "LLMCTL_NATIVE_GEMM"),
                          on_load=lambda module: module.set_isa(isa_level()))
native_unavailable_reason = EXTENSION.unavailable_reason
load_gemm_native = EXTENSION.load  # the module with the best ISA variant selected, or None


def fp32_linear_native(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same signature and result as ``fp32_linear_torch`` (up to fp32 summation order)."""
    return EXTENSION.require().linear(x, packed, out_features, bias)
