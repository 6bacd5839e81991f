"""GPTQ (Frantar et al., 2022): round a weight's columns one at a time and spread each column's
rounding error over the columns not yet rounded, weighted by how the layer's inputs correlate on
a calibration text (the Hessian ``H = sum x x^T`` of its inputs). Plain rounding minimises each
weight's own error; GPTQ minimises the layer's output error ``||(W - Q) X||`` on that text, which
is what the next layer sees.

The formats and kernels are the ones ``quantize.py`` fills. int4 takes each group's scale and min
from ``_int4_search``: on the group's weights as updated when its first column comes up, or, with
act-order (columns with the largest inputs first), on the weight before any update ("static
groups", so that a group stays a run of consecutive inputs); int8 and fp8 take their per-channel
scales from the weight before any update. The structure (lazy blocks of columns, the upper
Cholesky factor of the inverse Hessian, 1 % mean-diagonal damping, zeroed dead inputs) is the
reference implementation's. It runs where the weight and the Hessian are.
"""

from __future__ import annotations

import torch

from llmctl.layers.quantization.quantize import (
    FP8_E4M3_MAX,
    _int4_search,
    quantize,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from llmctl_kernels.packed_formats import PackedFp8, PackedInt4, PackedInt8, PackedWeight

# Columns per lazy update: inside a block each rounded column updates the block's later columns
# one at a time (N x B^2 / 2 work a block), the columns after it in one matrix product. 32 is the
# narrowest that still holds a whole int4 group of 32; groups searched as they come up need their
# group inside one block.
GPTQ_BLOCK = 32
GPTQ_DAMP = 0.01  # share of the mean diagonal added to H (the reference's percdamp)
_DAMP_RETRIES = 4  # a singular H (few calibration tokens, correlated inputs) gets 10x the damping


def _inverse_hessian_factor(hessian: torch.Tensor) -> torch.Tensor | None:
    """Upper Cholesky factor of ``(H + damping)^-1``, in float32 as the reference computes it (half
    the time of float64; the damping keeps it well conditioned); None if H stays singular."""
    hessian = hessian.float()
    damp = GPTQ_DAMP * hessian.diagonal().mean().clamp(min=1e-12)
    eye = torch.eye(hessian.shape[0], device=hessian.device)
    for _ in range(_DAMP_RETRIES):
        factor, info = torch.linalg.cholesky_ex(hessian + damp * eye)
        if info == 0:
            inverse, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(factor), upper=True)
            if info == 0:
                return inverse
        damp *= 10
    return None


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, kind: str, group_size: int | None = None, act_order: bool = False
) -> PackedWeight:
    """``weight`` ``[N, K]`` in ``kind``'s packed format (as ``quantize`` packs it), rounded by GPTQ
    against ``hessian`` ``[K, K]`` (sum of the calibration inputs' outer products). Falls back to
    ``quantize`` when the Hessian is all zeros or singular beyond damping. ``act_order`` rounds the
    columns with the largest inputs first (the reference's ``desc_act``); int4 groups then keep the
    scale and min searched on the weight before any update ("static groups"), so that a group is
    still a run of consecutive inputs."""
    w = weight.detach().float().clone()
    n, k = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}, weight needs {(k, k)}")
    if kind == "int4" and k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input features ({k})")
    h = hessian.float().clone()
    dead = h.diagonal() == 0  # inputs that were always zero (padding): their weights never matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    order = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else torch.arange(k, device=h.device)
    factor = _inverse_hessian_factor(h[order][:, order]) if not bool(dead.all()) else None
    if factor is None:  # per channel for int8, as the GPTQ path below
        return quantize(weight, kind, group_size if kind == "int4" else None)
    hinv = factor

    if kind == "int4":
        levels = torch.empty(n, k, dtype=torch.uint8, device=w.device)
        if act_order:
            static = quantize_int4(w, group_size)
            scales, mins = static.scales, static.mins
        else:
            scales, mins = (
                torch.empty(n, k // group_size, device=w.device),
                torch.empty(n, k // group_size, device=w.device),
            )
    elif kind == "int8":
        levels = torch.empty(n, k, dtype=torch.int8, device=w.device)
        channel_scales = quantize_int8(w).scales[:, 0]
    elif kind == "fp8":
        levels = torch.empty(n, k, dtype=torch.uint8, device=w.device)
        channel_scales = quantize_fp8(w).scales
    else:
        raise ValueError(f"unknown quantization {kind!r}; choose int8, int4 or fp8")

    def round_column(column: torch.Tensor, index: int) -> torch.Tensor:
        """Stores column ``index``'s codes, returns its dequantized values."""
        if kind == "int4":
            group = index // group_size
            q = torch.round((column - mins[:, group]) / scales[:, group]).clamp_(0, 15)
            levels[:, index] = q.to(torch.uint8)
            return q * scales[:, group] + mins[:, group]
        if kind == "int8":
            q = torch.round(column / channel_scales).clamp_(-127, 127)
            levels[:, index] = q.to(torch.int8)
            return q * channel_scales
        q = (column / channel_scales).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        levels[:, index] = q.view(torch.uint8)
        return q.float() * channel_scales

    w = w[:, order]  # columns in the order they are rounded
    columns = order.tolist()
    width = max(GPTQ_BLOCK, group_size) if kind == "int4" and not act_order else GPTQ_BLOCK
    for start in range(0, k, width):
        end = min(start + width, k)
        block = w[:, start:end].clone()
        errors = torch.empty(n, end - start, device=w.device)
        for i in range(end - start):
            if kind == "int4" and not act_order and (start + i) % group_size == 0:  # from the group's weights now
                group = (start + i) // group_size
                scales[:, group], mins[:, group] = _int4_search(block[:, i : i + group_size].contiguous())
            error = errors[:, i]
            torch.sub(block[:, i], round_column(block[:, i], columns[start + i]), out=error)
            error.div_(hinv[start + i, start + i])
            block[:, i:].addr_(error, hinv[start + i, start + i : end], alpha=-1)
        w[:, end:] -= errors @ hinv[start:end, end:]

    if kind == "int4":
        packed = levels[:, 0::2] | (levels[:, 1::2] << 4)  # low nibble = even k, as quantize_int4 packs
        return PackedInt4(packed.contiguous(), scales.contiguous(), mins.contiguous(), group_size)
    if kind == "int8":
        return PackedInt8(levels, channel_scales[:, None].contiguous(), None, k)
    return PackedFp8(levels, channel_scales.contiguous())
