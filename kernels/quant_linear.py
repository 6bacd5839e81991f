"""Torch references of the quantized linear kernels: dequantize the packed weight, then matmul.

Every native and Triton quantized kernel is tested against these; they are also the fallback where
no kernel applies (a CPU without the native build, an unusual group size).
"""

from __future__ import annotations

import dataclasses

import torch

from llmctl.layers.quantization.formats import PackedInt4, PackedWeight, dequantize

ACTIVATION_BLOCK = 32  # inputs per dynamic int8 activation scale (the native integer path)


def quant_linear_torch(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """``x [M, K] @ dequantize(packed)^T``, computed in float32, returned in ``x``'s dtype."""
    return (x.float() @ dequantize(packed).to(x.device).t()).to(x.dtype)


def activation_levels(packed: PackedWeight) -> int:
    """Integer levels of the native path's activations: int16 against int4 weights, int8 otherwise."""
    return 32767 if isinstance(packed, PackedInt4) else 127


def quantize_activations_torch(x: torch.Tensor, levels: int = 127) -> torch.Tensor:
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
    """The native integer path's arithmetic in torch: rounded activations (``activation_levels``)
    times the weight's ``scale * q`` part, plus each group's ``min`` times the exact float sum of x
    over the group."""
    q_only = dataclasses.replace(packed, mins=torch.zeros_like(packed.mins)) if packed.mins is not None else packed
    out = quantize_activations_torch(x, activation_levels(packed)) @ dequantize(q_only).t()
    if packed.mins is not None:
        out = out + x.float() @ packed.mins.repeat_interleave(packed.group_size, dim=1).t()
    return out.to(x.dtype)
