"""Triton weight-only quantized GEMM for CUDA: ``y = x @ dequantize(packed)^T`` for the int4, int8
and fp8 layouts of ``kernels/packed_formats.py``.

Each program computes a BLOCK_M x BLOCK_N tile of y: it loads a BLOCK_N x BLOCK_K tile of packed
weights (a byte per two int4 weights: each nibble is picked by k's parity; fp8 bytes are decoded
with integer ops, which also runs in the interpreter), dequantizes it in registers with the group's
scale/min, and feeds ``tl.dot`` (bf16/fp16 tensor cores on a GPU, fp32 in the interpreter). The
weight never exists in float in global memory. Tested against ``kernels/quant_linear.py`` under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmctl_kernels._triton_utils import cdiv, dots_in_fp32, fp32_dot_precision, last_dim_contiguous
from llmctl_kernels.packed_formats import PackedInt4, PackedInt8, PackedWeight

INT4, INT8, FP8 = 0, 1, 2


@triton.jit
def _fp8_e4m3_to_float(b):
    """e4m3fn bits (int32 0..255) -> float32: subnormals m * 2^-9, normals (8 + m) * 2^(e - 10)."""
    e = (b >> 3) & 0x0F
    m = (b & 0x07).to(tl.float32)
    magnitude = tl.where(e == 0, m * 0.001953125, (m + 8.0) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where((b & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def _quant_linear_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    mins_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    GROUP: tl.constexpr,  # inputs per scale (int4/int8); unused for fp8 (per-row scale)
    FORMAT: tl.constexpr,  # INT4 | INT8 | FP8
    HAS_MINS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        if FORMAT == 0:
            byte = tl.load(q_ptr + offs_n[:, None] * (K // 2) + (k // 2)[None, :], mask=w_mask, other=0).to(tl.int32)
            w = ((byte >> ((k % 2) * 4)[None, :]) & 0x0F).to(tl.float32)
        elif FORMAT == 1:
            w = tl.load(q_ptr + offs_n[:, None] * K + k[None, :], mask=w_mask, other=0).to(tl.float32)
        else:
            byte = tl.load(q_ptr + offs_n[:, None] * K + k[None, :], mask=w_mask, other=0).to(tl.int32)
            w = _fp8_e4m3_to_float(byte)
        if FORMAT != 2:
            g_offs = offs_n[:, None] * (K // GROUP) + (k // GROUP)[None, :]
            w = w * tl.load(s_ptr + g_offs, mask=w_mask, other=0.0)
            if HAS_MINS:
                w = w + tl.load(mins_ptr + g_offs, mask=w_mask, other=0.0)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision=DOT_PREC)
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if FORMAT == 2:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def quant_linear_triton(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """Same signature and result as ``quant_linear_torch`` (up to summation order and, on a GPU,
    the weights rounded to x's bf16/fp16 before the tensor-core product)."""
    x = last_dim_contiguous(x)
    m, k = x.shape
    n = packed.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    fmt = INT4 if isinstance(packed, PackedInt4) else INT8 if isinstance(packed, PackedInt8) else FP8
    mins = packed.mins if fmt != FP8 and packed.mins is not None else packed.scales  # dummy when unused
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = (32, 32) if dots_in_fp32(x.dtype) else (64, 64)
    group = packed.group_size if fmt != FP8 else k
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    _quant_linear_kernel[grid](
        x,
        packed.qweight,
        packed.scales,
        mins,
        out,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        GROUP=group,
        FORMAT=fmt,
        HAS_MINS=fmt != FP8 and packed.mins is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_FP32=dots_in_fp32(x.dtype),
        DOT_PREC=fp32_dot_precision(),
    )
    return out
