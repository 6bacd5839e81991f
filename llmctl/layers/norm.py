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


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm (Gemma 1/2/3): the checkpoint stores ``w`` and the scale is ``1 + w``, applied
    in fp32 before the cast back, as transformers' ``GemmaRMSNorm`` does (Llama's casts, then
    scales). Plain torch: the native kernel given ``1 + w`` differs in the last bit in fp32."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, ops: TorchOps) -> None:
        super().__init__(size, eps, dtype=dtype, ops=ops)
        self.weight.data.zero_()  # 1 + 0: the identity scale, as transformers initializes it

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(normed, new_residual)`` where ``new_residual = x + residual``."""
        if residual is not None:
            x = x + residual
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype), x
