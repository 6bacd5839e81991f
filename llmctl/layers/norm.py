"""RMSNorm module; the math (and its fused residual add) lives in the kernel set."""

from __future__ import annotations

import torch
from torch import nn

from llmctl.layers.ops import TorchOps


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, ops: TorchOps) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(normed, new_residual)`` where ``new_residual = x + residual``."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
