"""Packed weight formats that every quantized path shares (contract between loaders and kernels;
they live with the kernels, which read them, and llmctl's loaders import them from here).

One formula per format, so that GGUF blocks (Q4_0/Q4_1/Q4_K, Q8_0/Q5_K/Q6_K) and on-the-fly
quantization (``--quantization int4|int8|fp8``) land in the same few layouts the kernels read:

- ``PackedInt4``: ``w[n, k] = scales[n, k // G] * q[n, k] + mins[n, k // G]``, ``q`` in 0..15,
  two per byte (low nibble = even ``k``, high nibble = odd ``k``). Asymmetric int4 with zero point
  ``z`` is ``mins = -scales * z``; Q4_0 is ``mins = -8 * d``; Q4_1 is ``mins = m``.
- ``PackedInt8``: ``w[n, k] = scales[n, k // G] * q[n, k] (+ mins[n, k // G])``, ``q`` int8;
  ``G == K`` is per-output-channel.
- ``PackedFp8``: ``w[n, k] = scales[n] * float(e4m3fn bits[n, k])``.

All tensors are ``[N, ...]`` with the output features first, so merged projections (QKV,
gate-up) concatenate along dim 0. Scales and mins are float32 (the native CPU kernels may read float16
copies where those are exact: llmctl's ``quantization.params.kernel_packed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedInt4:
    qweight: torch.Tensor  # uint8 [N, K // 2]
    scales: torch.Tensor  # float32 [N, K // G]
    mins: torch.Tensor  # float32 [N, K // G]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 2


@dataclass
class PackedInt8:
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, K // G]
    mins: torch.Tensor | None  # float32 [N, K // G], or None (symmetric)
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)


@dataclass
class PackedFp8:
    qweight: torch.Tensor  # uint8 [N, K], float8_e4m3fn bit patterns
    scales: torch.Tensor  # float32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)


PackedWeight = PackedInt4 | PackedInt8 | PackedFp8


def _expand_groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    return values.repeat_interleave(group_size, dim=1)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> uint8 [N, K] in 0..15."""
    low, high = qweight & 0x0F, qweight >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def dequantize(packed: PackedWeight) -> torch.Tensor:
    """The reference: the float32 ``[N, K]`` weight a packed format stands for."""
    if isinstance(packed, PackedInt4):
        q = unpack_int4(packed.qweight).float()
        return q * _expand_groups(packed.scales, packed.group_size) + _expand_groups(packed.mins, packed.group_size)
    if isinstance(packed, PackedInt8):
        w = packed.qweight.float() * _expand_groups(packed.scales, packed.group_size)
        return w if packed.mins is None else w + _expand_groups(packed.mins, packed.group_size)
    if isinstance(packed, PackedFp8):
        return packed.qweight.view(torch.float8_e4m3fn).float() * packed.scales[:, None]
    raise TypeError(f"not a packed weight: {type(packed).__name__}")


def take_rows(packed: PackedWeight, rows: torch.Tensor) -> PackedWeight:
    """The same format restricted to output rows ``rows`` (an embedding lookup on a packed table)."""
    if isinstance(packed, PackedInt4):
        return PackedInt4(packed.qweight[rows], packed.scales[rows], packed.mins[rows], packed.group_size)
    if isinstance(packed, PackedInt8):
        mins = None if packed.mins is None else packed.mins[rows]
        return PackedInt8(packed.qweight[rows], packed.scales[rows], mins, packed.group_size)
    if isinstance(packed, PackedFp8):
        return PackedFp8(packed.qweight[rows], packed.scales[rows])
    raise TypeError(f"not a packed weight: {type(packed).__name__}")


def packed_tensors(packed: PackedWeight) -> dict[str, torch.Tensor]:
    """The tensors of a packed weight by field name (``mins`` left out when absent)."""
    fields = {"qweight": packed.qweight, "scales": packed.scales, "mins": getattr(packed, "mins", None)}
    return {name: tensor for name, tensor in fields.items() if tensor is not None}
