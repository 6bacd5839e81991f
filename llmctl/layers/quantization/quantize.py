"""On-the-fly quantization of a float ``[N, K]`` weight into the packed formats of ``formats.py``.

Each function works in float32 whatever the input dtype, so a bf16 checkpoint and its fp32 copy
quantize to the same packed weight.
"""

from __future__ import annotations

import torch

from llmctl.layers.quantization.formats import PackedFp8, PackedInt4, PackedInt8

FP8_E4M3_MAX = 448.0
_TINY = 1e-12  # keeps all-zero groups from dividing by zero (they quantize to exact zeros)


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    if group_size < 1 or k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input features ({k})")
    return w.float().reshape(n, k // group_size, group_size)


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> PackedInt8:
    """Symmetric int8 in -127..127 (so that negating stays in range), one scale per output channel
    (``group_size=None``) or per group of ``group_size`` inputs."""
    group_size = group_size or w.shape[1]
    groups = _groups(w, group_size)
    scales = groups.abs().amax(dim=-1).clamp(min=_TINY) / 127.0
    q = torch.round(groups / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return PackedInt8(q.reshape(w.shape).contiguous(), scales.contiguous(), None, group_size)


def quantize_int4(w: torch.Tensor, group_size: int = 64) -> PackedInt4:
    """Asymmetric int4 (AWQ-style): per group, ``scale = (max - min) / 15`` and an integer zero point
    ``z`` in 0..15, stored as ``mins = -scale * z``; ``q = clamp(round(w / scale) + z, 0, 15)``."""
    if group_size not in (32, 64, 128):
        raise ValueError(f"int4 group size must be 32, 64 or 128, got {group_size}")
    groups = _groups(w, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15.0).clamp(min=_TINY)
    zeros = torch.round(-low / scales).clamp(0, 15)
    q = (torch.round(groups / scales[..., None]) + zeros[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(w.shape[0], -1)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)  # low nibble = even k, high nibble = odd k
    return PackedInt4(packed.contiguous(), scales.contiguous(), (-scales * zeros).contiguous(), group_size)


def quantize_fp8(w: torch.Tensor) -> PackedFp8:
    """float8 e4m3fn with one float32 scale per output channel (the row's max maps to 448)."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=_TINY) / FP8_E4M3_MAX
    q = (w / scales[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return PackedFp8(q.view(torch.uint8).contiguous(), scales.contiguous())


def quantize(w: torch.Tensor, kind: str, group_size: int | None = None):
    """``kind`` is ``int8`` (``group_size`` None = per channel), ``int4`` (group 32/64/128) or
    ``fp8`` (per channel; ``group_size`` ignored)."""
    if kind == "int8":
        return quantize_int8(w, group_size)
    if kind == "int4":
        return quantize_int4(w, group_size or 64)
    if kind == "fp8":
        return quantize_fp8(w)
    raise ValueError(f"unknown quantization {kind!r}; choose none, int8, int4 or fp8")
