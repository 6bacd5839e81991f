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


def quantize_activations_torch(x: torch.Tensor) -> torch.Tensor:
    """What the native integer path multiplies with: x rounded to int8 per row and per block of 32
    inputs (scale = max|x| / 127, round half to even), returned dequantized in float32."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, torch.round(blocks * (127.0 / blocks.abs().amax(dim=-1, keepdim=True))), 0.0)
    return (q * scale).reshape(m, k)


def int_path_reference(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """The native integer path's arithmetic in torch: int8-rounded activations times the weight's
    ``scale * q`` part, plus each group's ``min`` times the exact float sum of x over the group."""
    q_only = dataclasses.replace(packed, mins=torch.zeros_like(packed.mins)) if packed.mins is not None else packed
    out = quantize_activations_torch(x) @ dequantize(q_only).t()
    if packed.mins is not None:
        out = out + x.float() @ packed.mins.repeat_interleave(packed.group_size, dim=1).t()
    return out.to(x.dtype)
