"""Torch references of the quantized linear kernels: dequantize the packed weight, then matmul.

Every native and Triton quantized kernel is tested against these; they are also the fallback where
no kernel applies (a CPU without the native build, an unusual group size).
"""

from __future__ import annotations

import dataclasses

import torch

from llmctl.layers.quantization.formats import PackedWeight, dequantize

ACTIVATION_BLOCK = 32  # inputs per dynamic int8 activation scale (the native integer path)


def quant_linear_torch(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """``x [M, K] @ dequantize(packed)^T``, computed in float32, returned in ``x``'s dtype."""
    return (x.float() @ dequantize(packed).to(x.device).t()).to(x.dtype)


ACTIVATION_LEVELS = 32767  # int16 activations: steps each side of zero


def quantize_activations_torch(x: torch.Tensor, levels: int = ACTIVATION_LEVELS) -> torch.Tensor:
    """What the native integer path multiplies with: x rounded per row and per block of 32 inputs
    to ``levels`` steps each side of zero (scale = max|x| / levels, round half to even), returned
    dequantized in float32."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = amax / float(levels)
    q = torch.where(scale > 0, torch.round(blocks * (float(levels) / amax)), 0.0)
    return (q * scale).reshape(m, k)


def int_path_reference(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """The native integer path's arithmetic in torch: int16-rounded activations times the weight's ``scale * q`` part, plus each group's ``min`` times the exact float sum of x
    over the group."""
    q_only = dataclasses.replace(packed, mins=torch.zeros_like(packed.mins)) if packed.mins is not None else packed
    out = quantize_activations_torch(x) @ dequantize(q_only).t()
    if packed.mins is not None:
        out = out + x.float() @ packed.mins.repeat_interleave(packed.group_size, dim=1).t()
    return out.to(x.dtype)
