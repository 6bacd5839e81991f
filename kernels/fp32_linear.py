"""fp32 linear layers with the weight packed once into panels of 16 output columns: the layout and
the torch reference of the native GEMM (kernels/cpu/gemm_kernels.cpp, loaded by
``llmctl_kernels.gemm_native``).

``packed[p, k, c] = weight[16 p + c, k]``, zero past the last output column: a micro-kernel then
reads 16 consecutive columns of one k with two aligned vector loads, and a panel's K values lie
contiguous in memory (one stream per panel, no gather).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PANEL = 16  # output columns per panel


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N / 16), K, 16]`` (contiguous, same dtype and device)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = F.pad(weight, (0, 0, 0, panels * PANEL - n)) if n % PANEL else weight
    return padded.reshape(panels, PANEL, k).transpose(1, 2).contiguous()


def unpack_panels(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of ``pack_panels``: the ``[out_features, K]`` weight."""
    panels, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * PANEL, k)[:out_features]


def fp32_linear_torch(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight^T + bias`` from the packed weight; the native kernel's reference (equal up to
    fp32 summation order: the kernel sums k in order, one fused multiply-add at a time)."""
    return F.linear(x, unpack_panels(packed, out_features), bias)
