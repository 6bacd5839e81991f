"""MXFP4 checkpoint tensors (``quantization_config.quant_method: mxfp4``, gpt-oss's released
checkpoints), dequantized while loading.

A quantized ``NAME`` is stored as two tensors: ``NAME_blocks`` ``[..., R, G, 16]`` uint8, each byte
two e2m1 codes (low nibble first), and ``NAME_scales`` ``[..., R, G]`` uint8, an e8m0 exponent per
group of 32 values (``2 ** (scale - 127)``). Value ``32 g + j`` of row ``r`` is
``FP4_VALUES[code] * 2 ** (scales[r, g] - 127)``, and the dequantized tensor is ``[..., G * 32, R]``
(its last two dimensions swapped, as transformers' ``convert_moe_packed_tensors`` returns it: the
layout of ``GptOssExperts.gate_up_proj`` / ``down_proj``). Every such value is exact in fp32 and
bf16 alike (for the scales real checkpoints hold), so the weights equal transformers' dequantized
ones bit for bit. There is no packed MXFP4 kernel: the experts take their dequantized size in
memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from llmctl.errors import ModelLoadError

# e2m1 code -> value (transformers' FP4_VALUES; bit 3 the sign)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SUFFIXES = ("_blocks", "_scales")


def is_mxfp4(raw_config: dict[str, Any]) -> bool:
    """Whether a config.json declares MXFP4 weights."""
    quant = raw_config.get("quantization_config") or {}
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``NAME_blocks`` ``[..., R, G, 16]`` and ``NAME_scales`` ``[..., R, G]`` -> ``[..., G * 32, R]``
    in ``dtype`` (module docstring)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., R, G, 32]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(lut[codes.long()], exponents.unsqueeze(-1))  # exact: a power of two times e2m1
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()


def dequantized_tensors(
    tensors: Iterator[tuple[Path, str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """The checkpoint's tensors with every ``NAME_blocks`` / ``NAME_scales`` pair replaced by the
    dequantized ``NAME`` (in ``dtype``), as soon as both halves have been read; the others as they
    come. A half without its partner is an error naming the file."""
    pending: dict[str, tuple[Path, str, torch.Tensor]] = {}
    for path, name, tensor in tensors:
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield path, name, tensor
            continue
        base = name.removesuffix(suffix)
        other = pending.pop(base, None)
        if other is None:
            pending[base] = (path, suffix, tensor)
            continue
        halves = {suffix: tensor, other[1]: other[2]}
        if len(halves) != 2:
            raise ModelLoadError(f"{path}: MXFP4 tensor {name!r} appears twice")
        try:
            yield path, base, dequantize(halves["_blocks"], halves["_scales"], dtype)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: MXFP4 tensor {base!r}: {exc}") from exc
    if pending:
        base, (path, suffix, _) = next(iter(pending.items()))
        missing = "_scales" if suffix == "_blocks" else "_blocks"
        raise ModelLoadError(f"{path}: MXFP4 tensor {base + suffix!r} has no {base + missing!r}")
