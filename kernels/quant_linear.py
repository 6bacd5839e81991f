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


INT8_ACTIVATION_LEVELS = 127 * 255 + 127  # the many-row path (kernels/cpu/qgemm.h): two int8 digits


def int8_activation_reference(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """The many-row integer path (kernels/cpu/qgemm.h) in torch: x rounded per row and per 32-input
    block to ``INT8_ACTIVATION_LEVELS`` steps (scale = max|x| / levels, round half to even; the
    kernel holds each as two int8 digits), each block's (for groups of 16: each half block's) exact
    integer dot product with the weight's ``q`` times ``w_scale * x_scale`` (rounded to float32 as
    the kernel does), summed in float64; plus each group's ``min`` times the float sum of x over
    the group. The kernel sums the same
    terms in float32 by fused multiply-adds in block order: they differ by that rounding only."""
    m, k = x.shape
    n = packed.shape[0]
    nb, group = k // ACTIVATION_BLOCK, packed.group_size
    blocks = x.float().reshape(m, nb, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    steps = torch.full_like(amax, float(INT8_ACTIVATION_LEVELS))
    inv = torch.where(amax > 0, steps / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv[..., None])  # [m, nb, 32], integers
    x_scale = amax / steps  # [m, nb]
    no_mins = None if isinstance(packed, PackedInt8) else torch.zeros_like(packed.scales, dtype=torch.float32)
    q_only = dataclasses.replace(packed, scales=torch.ones_like(packed.scales, dtype=torch.float32), mins=no_mins)
    # one integer dot per part of a block with one weight scale: the block, or each half for groups of 16
    part = min(group, ACTIVATION_BLOCK)
    parts = k // part
    wq = dequantize(q_only).reshape(n, parts, part)  # the integer codes q
    dots = torch.einsum("mbj,nbj->mnb", xq.reshape(m, parts, part).double(), wq.double())  # exact: |dot| < 2^28
    w_scale = packed.scales.float().repeat_interleave(group // part, dim=1)  # [n, parts]
    x_scale = x_scale.repeat_interleave(ACTIVATION_BLOCK // part, dim=1)  # [m, parts]
    scale = (w_scale[None, :, :] * x_scale[:, None, :]).double()  # float32 products, as the kernel's
    out = (dots * scale).sum(-1)
    if packed.mins is not None:
        sums = x.float().reshape(m, k // group, group).sum(-1).double()
        out = out + sums @ packed.mins.double().t()
    return out.to(x.dtype)
