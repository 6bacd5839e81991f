"""The native fp32 panel GEMM (C++ in kernels/cpu/gemm_kernels.cpp; torch reference in
kernels/fp32_linear.py), compiled at install time into ``llmctl_kernels._C.gemm``.

Optional: where it was not built, fp32 linear layers keep torch's GEMM (whether to use it at all is
llmctl's choice). The ISA variant (generic, AVX2+FMA, AVX-512) is chosen at run time from
``llmctl_kernels.cpu_features`` (capped by ``set_isa_cap``).
"""

from __future__ import annotations

import torch

from llmctl_kernels.cpu_features import isa_level, on_isa_cap_change
from llmctl_kernels.native_module import NativeKernels


def _select_variant(module) -> None:
    module.set_isa(isa_level())
    on_isa_cap_change(lambda: module.set_isa(isa_level()))


EXTENSION = NativeKernels("gemm", on_load=_select_variant)
native_unavailable_reason = EXTENSION.unavailable_reason
load_gemm_native = EXTENSION.load  # the module with the best ISA variant selected, or None


def fp32_linear_native(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Same signature and result as ``fp32_linear_torch`` (up to fp32 summation order)."""
    return EXTENSION.require().linear(x, packed, out_features, bias)
