"""Triton kernels for the memory-bound ops: KV store, fused RMSNorm, rotary embedding, SiLU-and-mul.

Imported lazily by the ``*_triton`` wrappers. Arithmetic runs in fp32 (loads are upcast first:
the interpreter keeps bf16 as raw uint16), and where the torch reference rounds an intermediate
to the input dtype the kernel rounds it too, so results match the references to the last bit in
most elements and within one rounding step elsewhere.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_to(x, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE``. GPUs round bf16 casts to nearest-even like torch; the
    interpreter truncates, so there (``EMULATE_RNE``) the rounding is done on the bits first."""
    if EMULATE_RNE:
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # leave NaNs alone
    return x.to(DTYPE)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, HEAD_DIM]
    value_ptr,
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    value_cache_ptr,
    slot_mapping_ptr,  # [num_tokens], -1 = skip
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # page size
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t = token.to(tl.int64)

    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = key_cache_ptr + block * stride_kcb + offset * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    vc = value_cache_ptr + block * stride_vcb + offset * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    if k.dtype != key_cache_ptr.dtype.element_ty:
        k = _round_to(k.to(tl.float32), key_cache_ptr.dtype.element_ty, EMULATE_RNE)
    if v.dtype != value_cache_ptr.dtype.element_ty:
        v = _round_to(v.to(tl.float32), value_cache_ptr.dtype.element_ty, EMULATE_RNE)
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden] (HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden], dtype of weight * x
    new_residual_ptr,  # [num_tokens, hidden] (HAS_RESIDUAL): x + residual in x's dtype
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = _round_to(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty, EMULATE_RNE)  # HF adds in x's dtype
        tl.store(new_residual_ptr + row * stride_nr + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / HIDDEN
    normed = _round_to(xf * tl.rsqrt(variance + eps), x_ptr.dtype.element_ty, EMULATE_RNE)  # cast back, then scale
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, _round_to(out, out_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    stride_xh,
    stride_oh,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """Rotate-half on the first ``2 * HALF`` dims of ``NUM_HEADS`` heads of one token (pointers
    already at the token's row), copying the rest. Each product and the sum are rounded to the
    input dtype, as the reference's per-op torch arithmetic does."""
    dtype = x_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_HALF)
    h_mask = offs_h < NUM_HEADS
    mask = h_mask[:, None] & (offs_r[None, :] < HALF)
    x_rows = x_ptr + offs_h[:, None] * stride_xh
    o_rows = out_ptr + offs_h[:, None] * stride_oh
    x1 = tl.load(x_rows + offs_r[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + HALF + offs_r[None, :], mask=mask, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    a1 = _round_to(x1 * c, dtype, EMULATE_RNE).to(tl.float32)
    b1 = _round_to(-(x2 * s), dtype, EMULATE_RNE).to(tl.float32)
    a2 = _round_to(x2 * c, dtype, EMULATE_RNE).to(tl.float32)
    b2 = _round_to(x1 * s, dtype, EMULATE_RNE).to(tl.float32)
    tl.store(o_rows + offs_r[None, :], _round_to(a1 + b1, dtype, EMULATE_RNE), mask=mask)
    tl.store(o_rows + HALF + offs_r[None, :], _round_to(a2 + b2, dtype, EMULATE_RNE), mask=mask)
    if PASS > 0:
        offs_p = tl.arange(0, BLOCK_PASS)
        p_mask = h_mask[:, None] & (offs_p[None, :] < PASS)
        xp = tl.load(x_rows + 2 * HALF + offs_p[None, :], mask=p_mask, other=0.0)
        tl.store(o_rows + 2 * HALF + offs_p[None, :], xp, mask=p_mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens]
    q_ptr,  # [num_tokens, NUM_Q_HEADS, HEAD_DIM]
    k_ptr,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM]
    q_out_ptr,
    k_out_ptr,
    cos_sin_ptr,  # [max_positions, 2 * HALF] fp32: cos | sin
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PASS: tl.constexpr,  # HEAD_DIM - 2 * HALF dims copied through unrotated
    BLOCK_PASS: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_HALF)
    r_mask = offs_r < HALF
    cs = cos_sin_ptr + pos * stride_cs
    dtype = q_ptr.dtype.element_ty
    # the reference casts cos/sin to the input dtype before multiplying
    cos = _round_to(tl.load(cs + offs_r, mask=r_mask, other=0.0), dtype, EMULATE_RNE).to(tl.float32)
    sin = _round_to(tl.load(cs + HALF + offs_r, mask=r_mask, other=0.0), dtype, EMULATE_RNE).to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_qt,
        q_out_ptr + token * stride_qot,
        stride_qh,
        stride_qoh,
        cos,
        sin,
        NUM_Q_HEADS,
        HEAD_DIM,
        HALF,
        BLOCK_HQ,
        BLOCK_HALF,
        PASS,
        BLOCK_PASS,
        EMULATE_RNE,
    )
    _rotate_heads(
        k_ptr + token * stride_kt,
        k_out_ptr + token * stride_kot,
        stride_kh,
        stride_koh,
        cos,
        sin,
        NUM_KV_HEADS,
        HEAD_DIM,
        HALF,
        BLOCK_HK,
        BLOCK_HALF,
        PASS,
        BLOCK_PASS,
        EMULATE_RNE,
    )


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_tokens, 2 * D]: gate | up
    out_ptr,  # [num_tokens, D]
    stride_x,
    stride_o,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    act = _round_to(gate / (1.0 + tl.exp(-gate)), dtype, EMULATE_RNE).to(tl.float32)  # F.silu rounds
    tl.store(out_ptr + row * stride_o + offs, _round_to(act * up, out_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)
