"""MXFP4 checkpoint tensors (``quantization_config.quant_method: mxfp4``, gpt-oss's released
checkpoints): the experts kept packed, or every tensor dequantized while loading.

A quantized ``NAME`` is stored as two tensors: ``NAME_blocks`` ``[..., R, G, 16]`` uint8, each byte
two e2m1 codes (low nibble first), and ``NAME_scales`` ``[..., R, G]`` uint8, an e8m0 exponent per
group of 32 values (``2 ** (scale - 127)``). Value ``32 g + j`` of row ``r`` is
``FP4_VALUES[code] * 2 ** (scales[r, g] - 127)``, and the dequantized tensor is ``[..., G * 32, R]``
(its last two dimensions swapped, as transformers' ``convert_moe_packed_tensors`` returns it: the
layout of ``GptOssExperts.gate_up_proj`` / ``down_proj``). Every such value is exact in fp32 and
bf16 alike (for the scales real checkpoints hold), so the weights equal transformers' dequantized
ones bit for bit.

Kept packed (``--quantization auto``), an expert projection is ``PackedInt8`` with groups of 32: the
e2m1 values doubled are the integers -12..12 and the scale halved, ``2 ** (scale - 128)``, is a
power of two, so the packed weight stands for exactly the same values (llama.cpp's MXFP4 reads
them the same way) at one byte a weight plus a float scale per 32, a quarter of float32's size,
and runs on the int8 kernels every packed layer uses. Rows are output features: a
``gate_up_proj_blocks`` row is a column of transformers' ``gate_up_proj``, gate and up alternating.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from llmctl.errors import ModelLoadError
from llmctl.layers.moe import PackedExpertWeights
from llmctl_kernels.packed_formats import PackedInt8, take_rows

# e2m1 code -> value (transformers' FP4_VALUES; bit 3 the sign)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# e2m1 code -> twice its value (llama.cpp's kvalues_mxfp4), the int8 grid of the packed form
_DOUBLED_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_SUFFIXES = ("_blocks", "_scales")
# the stacked expert projections a packed load keeps packed: ``<layer>.mlp.experts.<proj>``
_EXPERT_PROJECTION = re.compile(r"(.+\.experts)\.(gate_up_proj|down_proj)")


def is_mxfp4(raw_config: dict[str, Any]) -> bool:
    """Whether a config.json declares MXFP4 weights."""
    quant = raw_config.get("quantization_config") or {}
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``NAME_blocks`` ``[..., R, G, 16]`` and ``NAME_scales`` ``[..., R, G]`` -> ``[..., G * 32, R]``
    in ``dtype`` (module docstring)."""
    _check(blocks, scales)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., R, G, 32]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(lut[codes.long()], exponents.unsqueeze(-1))  # exact: a power of two times e2m1
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()


def half_scales(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 exponents (uint8) -> ``2 ** (scale - 128)`` in float32, built from the bits (exponents 0
    and 1 are float32 subnormals), as llama.cpp's ``ggml_e8m0_to_fp32_half``."""
    e = scales.to(torch.int32)
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def packed_experts(blocks: torch.Tensor, scales: torch.Tensor) -> list[PackedInt8]:
    """Stacked ``NAME_blocks`` ``[E, R, G, 16]`` and ``NAME_scales`` ``[E, R, G]`` -> one
    ``PackedInt8`` ``[R, G * 32]`` (groups of 32) per expert, exactly (module docstring); one
    expert's temporaries at a time."""
    _check(blocks, scales)
    if blocks.dim() != 4:
        raise ValueError(f"expected stacked experts' blocks [E, R, G, 16], got {tuple(blocks.shape)}")
    byte_values = torch.tensor(_DOUBLED_VALUES, dtype=torch.int8)
    pairs = torch.stack([byte_values.repeat(16), byte_values.repeat_interleave(16)], dim=-1)  # byte -> (low, high)
    experts = []
    for e in range(blocks.shape[0]):
        qweight = pairs[blocks[e].long()].flatten(-3)  # [R, G * 32]: low nibble first
        experts.append(PackedInt8(qweight, half_scales(scales[e]), None, 32))
    return experts


def _expert_weights(projections: dict[str, list[PackedInt8]]) -> PackedExpertWeights:
    """A layer's packed ``gate_up_proj`` (gate and up rows alternating) and ``down_proj``."""
    gate_up = projections["gate_up_proj"]
    rows = gate_up[0].shape[0]
    gate = [take_rows(p, torch.arange(0, rows, 2)) for p in gate_up]
    up = [take_rows(p, torch.arange(1, rows, 2)) for p in gate_up]
    return PackedExpertWeights(gate, up, projections["down_proj"])


def is_expert_tensor(name: str) -> bool:
    """Whether ``name`` is half of an MXFP4 expert projection (what ``packed_expert_layers`` reads)."""
    base = next((name.removesuffix(s) for s in _SUFFIXES if name.endswith(s)), None)
    return base is not None and _EXPERT_PROJECTION.fullmatch(base) is not None


def packed_expert_layers(
    tensors: Iterator[tuple[Path, str, torch.Tensor]],
) -> Iterator[tuple[Path, str, PackedExpertWeights]]:
    """``(file, "<layer>.mlp.experts", weights)`` for each layer once both of its MXFP4 expert
    projections have been read, from a stream of ``is_expert_tensor`` tensors."""
    layers: dict[str, dict[str, list[PackedInt8]]] = {}
    for path, base, blocks, scales in _paired(tensors):
        match = _EXPERT_PROJECTION.fullmatch(base)
        if match is None or scales is None:
            raise ModelLoadError(f"{path}: {base!r} is not a stacked expert projection")
        try:
            projections = layers.setdefault(match[1], {})
            projections[match[2]] = packed_experts(blocks, scales)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: MXFP4 tensor {base!r}: {exc}") from exc
        if len(projections) == 2:
            yield path, match[1], _expert_weights(layers.pop(match[1]))
    if layers:
        prefix, projections = next(iter(layers.items()))
        raise ModelLoadError(f"{prefix}: MXFP4 experts have {sorted(projections)} but not both projections")


def _paired(
    tensors: Iterator[tuple[Path, str, torch.Tensor]],
) -> Iterator[tuple[Path, str, torch.Tensor, torch.Tensor | None]]:
    """``(file, NAME, blocks, scales)`` for every ``NAME_blocks`` / ``NAME_scales`` pair as soon as
    both halves have been read, ``(file, name, tensor, None)`` for the others as they come. A half
    without its partner is an error naming the file."""
    pending: dict[str, tuple[Path, str, torch.Tensor]] = {}
    for path, name, tensor in tensors:
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield path, name, tensor, None
            continue
        base = name.removesuffix(suffix)
        other = pending.pop(base, None)
        if other is None:
            pending[base] = (path, suffix, tensor)
            continue
        halves = {suffix: tensor, other[1]: other[2]}
        if len(halves) != 2:
            raise ModelLoadError(f"{path}: MXFP4 tensor {name!r} appears twice")
        yield path, base, halves["_blocks"], halves["_scales"]
    if pending:
        base, (path, suffix, _) = next(iter(pending.items()))
        missing = "_scales" if suffix == "_blocks" else "_blocks"
        raise ModelLoadError(f"{path}: MXFP4 tensor {base + suffix!r} has no {base + missing!r}")


def dequantized_tensors(
    tensors: Iterator[tuple[Path, str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """The checkpoint's tensors with every ``NAME_blocks`` / ``NAME_scales`` pair replaced by the
    dequantized ``NAME`` (in ``dtype``), as soon as both halves have been read; the others as they
    come. A half without its partner is an error naming the file."""
    for path, name, tensor, scales in _paired(tensors):
        if scales is None:
            yield path, name, tensor
            continue
        try:
            yield path, name, dequantize(tensor, scales, dtype)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: MXFP4 tensor {name!r}: {exc}") from exc
