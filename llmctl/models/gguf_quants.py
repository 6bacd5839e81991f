"""GGUF tensor blocks -> llmctl's shared packed formats, exactly (no requantization).

Every GGML block type llmctl reads is an affine map of small integers per group of 16 or 32
weights, which is what ``PackedInt4`` / ``PackedInt8`` (kernels/packed_formats.py)
express, so the kernels need no GGML-specific code:

========  ======================================  ==========================================
type      GGML formula per group                  packed as
========  ======================================  ==========================================
Q4_0      ``d * (q - 8)``, 32 per block           PackedInt4 G=32, scale ``d``, min ``-8 d``
Q4_1      ``d * q + m``                           PackedInt4 G=32, scale ``d``, min ``m``
Q4_K      ``d sc * q - dmin m``, 8 x 32 in 256    PackedInt4 G=32, scale ``d sc``, min ``-dmin m``
Q5_0      ``d * (q - 16)``                        PackedInt8 G=32, q - 16, scale ``d``
Q5_1      ``d * q + m``                           PackedInt8 G=32 with mins
Q5_K      ``d sc * q - dmin m``, 5-bit q          PackedInt8 G=32 with mins
Q6_K      ``d sc * (q - 32)``, 16 x 16 in 256     PackedInt8 G=16, q - 32, scale ``d sc``
Q8_0      ``d * q``                               PackedInt8 G=32
MXFP4     ``2^(e-127) e2m1(q)``, 32 per block    PackedInt8 G=32, ``2 e2m1(q)``, ``2^(e-128)``
========  ======================================  ==========================================

MXFP4's e2m1 values doubled are small integers (llama.cpp's ``kvalues_mxfp4``) and its e8m0 scale
halved is a power of two, so it too is an int8 grid exactly: one byte a weight where the file has
half of one, a quarter of float32's size. The other scales and mins are products of an fp16 value
and an integer of at most 8 bits, hence exact in float32, and ``scale * q + min`` then rounds
exactly like the reference ``gguf.quants.dequantize`` (the tests compare bit for bit). The bit
unpacking follows ``gguf.quants`` block by block.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmctl_kernels.packed_formats import PackedInt4, PackedInt8, PackedWeight, dequantize, unpack_int4

T = GGMLQuantizationType
DENSE_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
QUANTIZED_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q8_0, T.MXFP4)
SUPPORTED_TYPES = tuple(DENSE_TYPES) + QUANTIZED_TYPES
_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 [..., K] in 0..15 -> [..., K // 2], even k in the low nibble (PackedInt4's order)."""
    pairs = q.reshape(*q.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << np.uint8(4))


def _split_nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """GGML's nibble order: each ``run`` bytes hold ``run`` elements in their low nibbles, then the
    next ``run`` elements in their high nibbles. [B, n] -> uint8 [B, 2 n] in element order."""
    blocks = qs.shape[0]
    split = qs.reshape(blocks, -1, 1, run) >> _NIBBLE_SHIFTS.reshape(1, 1, 2, 1)
    return (split & np.uint8(0x0F)).reshape(blocks, -1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K super-block (gguf.quants.Q4_K)."""
    from gguf.quants import Q4_K

    sc, mn = Q4_K.get_scale_min(scales)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q5_high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: one uint32 per block, bit i = the fifth bit of element i."""
    bits = qh.copy().view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return (bits & np.uint32(1)).astype(np.uint8)


def _decode(blocks: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """[B, type_size] blocks -> (q [B, block], scales [B, groups], mins [B, groups] or None, group)."""
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        d, rest = _f16(blocks[:, :2]), blocks[:, 2:]
        m = None
        if qtype in (T.Q4_1, T.Q5_1):
            m, rest = _f16(rest[:, :2]), rest[:, 2:]
        if qtype == T.Q8_0:
            return rest.view(np.int8), d, None, 32
        if qtype in (T.Q4_0, T.Q4_1):
            q = _split_nibbles(rest, 16)
            return q, d, (-8 * d if qtype == T.Q4_0 else m), 32
        q = _split_nibbles(rest[:, 4:], 16) | (_q5_high_bits(rest[:, :4]) << np.uint8(4))
        return (q.astype(np.int8) - np.int8(16), d, None, 32) if qtype == T.Q5_0 else (q, d, m, 32)
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scale_min(blocks[:, 4:16])
        q = _split_nibbles(blocks[:, -128:], 32)
        if qtype == T.Q5_K:
            qh = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = q | ((qh & np.uint8(1)).reshape(q.shape) << np.uint8(4))
        return q, d * sc, -(dmin * mn), 32
    if qtype == T.Q6_K:
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        scales, d = blocks[:, 192:208].view(np.int8).astype(np.float32), _f16(blocks[:, 208:210])
        low = _split_nibbles(ql, 64)
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        q = (low | (high.reshape(low.shape) << np.uint8(4))).astype(np.int8) - np.int8(32)
        return q, d * scales, None, 16
    if qtype == T.MXFP4:
        from gguf.quants import MXFP4

        pairs = _mxfp4_byte_values()[blocks[:, 1:]].view(np.int8).reshape(-1, 16, 2)
        q = pairs.transpose(0, 2, 1).reshape(-1, 32)  # llama.cpp's order: the 16 low nibbles, then the high
        return q, MXFP4.e8m0_to_fp32_half(blocks[:, :1]), None, 32
    raise ValueError(f"no repacking for GGML type {qtype.name}")


@functools.cache
def _mxfp4_byte_values() -> np.ndarray:
    """Byte -> the int8 values of its low and its high nibble (MXFP4's doubled e2m1 values) as one
    int16: one table lookup a byte, several times faster than unpacking the nibbles first."""
    from gguf.quants import MXFP4

    values, byte = np.array(MXFP4.kvalues, dtype=np.int8), np.arange(256)
    return np.stack([values[byte & 15], values[byte >> 4]], axis=1).copy().view(np.int16).reshape(256)


def repack(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> PackedWeight:
    """A quantized GGUF matrix (raw bytes [N, row_bytes], ``shape`` = (N, K)) as a packed weight."""
    rows, cols = shape
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raw).reshape(-1, type_size)
    q, scales, mins, group = _decode(blocks, qtype)
    groups = cols // group
    scales_t = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(rows, groups))
    mins_t = (
        None if mins is None else torch.from_numpy(np.ascontiguousarray(mins, dtype=np.float32).reshape(rows, groups))
    )
    if qtype in (T.Q4_0, T.Q4_1, T.Q4_K):
        qweight = torch.from_numpy(_pack_nibbles(q.reshape(rows, cols)))
        return PackedInt4(qweight, scales_t, mins_t, group)
    qweight = torch.from_numpy(np.ascontiguousarray(q.reshape(rows, cols)).view(np.int8))
    return PackedInt8(qweight, scales_t, mins_t, group)


def repack_experts(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int, int]) -> list[PackedWeight]:
    """A quantized stack of expert matrices (``shape`` = (E, N, K)) as one packed weight per
    expert: each expert's rows are whole blocks, so its slice repacks as a matrix does."""
    experts, rows, cols = shape
    per_expert = np.ascontiguousarray(raw).reshape(experts, -1)
    return [repack(per_expert[e], qtype, (rows, cols)) for e in range(experts)]


def dense(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """An F32/F16/BF16 tensor, copied out of the memory map."""
    data = np.ascontiguousarray(raw)
    if qtype == T.BF16:
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(data.copy()).reshape(shape)


def dequantized(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """A quantized tensor as float32, by ``gguf.quants.dequantize`` (the format authors' reference):
    stacked experts ``[experts, out, in]`` where they are not kept packed (``--quantization none``,
    a float stack beside them), and tensors of more than two dimensions."""
    from gguf.quants import dequantize as gguf_dequantize

    return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, qtype), dtype=np.float32)).reshape(shape)


def _as_int8(packed: PackedWeight, group: int) -> PackedInt8:
    """Any PackedInt4/PackedInt8 as PackedInt8 with mins at a finer group size (exactly)."""
    if isinstance(packed, PackedInt4):
        qweight = unpack_int4(packed.qweight).to(torch.int8)
    else:
        qweight = packed.qweight
    repeat = packed.group_size // group
    mins = packed.mins if packed.mins is not None else torch.zeros_like(packed.scales)
    return PackedInt8(qweight, packed.scales.repeat_interleave(repeat, 1), mins.repeat_interleave(repeat, 1), group)


def formats_differ(parts: list[PackedWeight]) -> bool:
    """Whether int4/int8 parts of a merged projection come in different formats (type, group size,
    mins): concatenated they would meet in ``concat_parts``' common format."""
    if not all(isinstance(p, (PackedInt4, PackedInt8)) for p in parts):
        return False
    first = parts[0]
    return not all(
        type(p) is type(first) and p.group_size == first.group_size and (p.mins is None) == (first.mins is None)
        for p in parts
    )


def format_runs(parts: list[PackedWeight]) -> list[list[PackedWeight]]:
    """The parts in runs of neighbours that share one format (each run concatenates as it is)."""
    runs: list[list[PackedWeight]] = []
    for part in parts:
        if runs and not formats_differ([runs[-1][0], part]):
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def concat_parts(parts: list[PackedWeight]) -> PackedWeight | None:
    """Merged projections (QKV, gate-up) stack their parts along the output rows. Parts in
    different formats meet in PackedInt8 with mins at the smallest group size, which holds every
    int4/int8 format exactly. None when a part is not an int4/int8 packed weight."""
    if not all(isinstance(p, (PackedInt4, PackedInt8)) for p in parts):
        return None
    first = parts[0]
    if formats_differ(parts):
        group = min(p.group_size for p in parts)
        parts = [_as_int8(p, group) for p in parts]
        first = parts[0]

    def cat(name: str) -> torch.Tensor:  # numpy's concatenate: no thread pool to wake for a copy at load time
        return torch.from_numpy(np.concatenate([getattr(p, name).numpy() for p in parts]))

    if isinstance(first, PackedInt4):
        return PackedInt4(cat("qweight"), cat("scales"), cat("mins"), first.group_size)
    return PackedInt8(cat("qweight"), cat("scales"), None if first.mins is None else cat("mins"), first.group_size)


def to_float(weight: PackedWeight | torch.Tensor) -> torch.Tensor:
    """The float32 value of a GGUF tensor, packed or dense (the ``--quantization none`` path)."""
    return weight.float() if isinstance(weight, torch.Tensor) else dequantize(weight)
