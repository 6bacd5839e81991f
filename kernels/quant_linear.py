"""Torch references of the quantized linear kernels: dequantize the packed weight, then matmul.

Every native and Triton quantized kernel is tested against these; they are also the fallback where
no kernel applies (a CPU without the native build, an unusual group size).
"""

from __future__ import annotations

import dataclasses

import torch

from llmctl_kernels.packed_formats import PackedInt8, PackedWeight, dequantize

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


def is_per_channel_int8(packed: PackedWeight) -> bool:
    """Per-output-channel symmetric int8 (group == K, no mins): the native path rounds activations
    per token, not per 32-input block (kernels/cpu/int8_gemm.h)."""
    return isinstance(packed, PackedInt8) and packed.mins is None and packed.group_size == packed.shape[1]


def quantize_tokens_torch(x: torch.Tensor, levels: int = ACTIVATION_LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] rounded per row to int16 steps: (integer-valued q [M, K], scale [M]), with
    ``x ~= q * scale``; scale = max|x row| / levels, q = round_half_even(x * (levels / max|x row|))."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    steps = torch.full_like(amax, float(levels))  # tensor / tensor divides exactly (a scalar may become a reciprocal)
    inv = torch.where(amax > 0, steps / amax, torch.zeros_like(amax))
    return torch.round(x * inv[:, None]), amax / steps


def per_channel_int8_reference(x: torch.Tensor, packed: PackedInt8) -> torch.Tensor:
    """Bit for bit what kernels/cpu/int8_gemm.h computes: the exact integer dot products S of the
    per-token int16 activations and the int8 weights (float64 holds them exactly: |S| < 2^53), then
    ``float32(S) * (x_scale[m] * w_scale[n])``, returned in float32."""
    q, x_scale = quantize_tokens_torch(x)
    sums = q.double() @ packed.qweight.double().t()
    return sums.float() * (x_scale[:, None] * packed.scales.float().reshape(1, -1))


def int_path_reference(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """The native integer path's arithmetic in torch: int16-rounded activations times the weight's
    ``scale * q`` part, plus each group's ``min`` times the exact float sum of x over the group.
    Per-channel int8 rounds per token and is bitwise the kernel's (``per_channel_int8_reference``)."""
    if is_per_channel_int8(packed):
        return per_channel_int8_reference(x, packed).to(x.dtype)
    q_only = dataclasses.replace(packed, mins=torch.zeros_like(packed.mins)) if packed.mins is not None else packed
    out = quantize_activations_torch(x) @ dequantize(q_only).t()
    if packed.mins is not None:
        out = out + x.float() @ packed.mins.repeat_interleave(packed.group_size, dim=1).t()
    return out.to(x.dtype)
