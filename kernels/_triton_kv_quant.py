"""Triton kernels over the quantized paged KV cache (``--kv-cache-dtype``), imported lazily by the
``*_quantized_triton`` wrappers in kernels/decode_attention.py, prefill_attention.py, kv_store.py.

Layouts and rounding rules are those of the torch references in ``kernels/kv_quant.py`` (storage
shapes in ``llmctl/engine/kv_cache.py``); every kernel takes per-tensor strides, so it reads one
layer's slice of the ``[layers, blocks, ...]`` pool in place:

- per-token formats (fp8_e4m3, fp8_e5m2, int8): codes ``[blocks, bs, H, D]`` and a float32 scale
  ``[blocks, bs, H]``; dequantized as ``code * scale``.
- KIVI: 2/4-bit codes packed along ``D`` (``[blocks, bs, H, D*bits/8]``), float16 scale/zero per
  (block, head, channel) for keys and per (block, token, head, channel group) for values;
  dequantized as ``code * scale + zero``.

One dequantizing tile loader serves both: a per-token scale sits at ``block * sb + tok * st``;
KIVI's scale (and zero) of channel ``d`` at ``block * sb + tok * st + (d // SCALE_DIV) * sd``
(keys: ``st = 0``).
Dequantized values are rounded to the query dtype, as the reference does, before the dots.

Attention reuses the float kernels' structure (kernels/_triton_attention.py): online softmax in
the log2 domain, GQA groups per program, split-K decode merged by ``_decode_reduce_kernel``.

Quantization (the store) never uses Triton's fp32 -> fp8 cast: the interpreter rounds it wrongly
at binade edges (e.g. 127.18 -> 64), so codes are built from the float bits (round to nearest
even, saturating), which matches torch's cast bit for bit on both the interpreter and a GPU.
Divisions are ``div_rn`` (a GPU's ``/`` is approximate) so scales and codes match torch exactly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from llmctl_kernels._triton_elementwise import _round_to

RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (y + M) - M rounds |y| < 2**22 to an integer, half to even


# ---- dequantization ------------------------------------------------------------------------------
@triton.jit
def _dequant_tile(
    codes_ptr,
    scale_ptr,
    zero_ptr,  # one KV head's base pointers
    block,
    tok,
    offs_d,
    n_mask,
    d_mask,  # block ids / token offsets [BLOCK_N] (int64), channels [BLOCK_D]
    stride_cb,
    stride_ct,
    stride_sb,
    stride_st,
    stride_sd,
    BITS: tl.constexpr,  # 8: one code per byte, one scale per row, no zero (per-token formats); 2/4: KIVI
    SCALE_DIV: tl.constexpr,  # channels per scale entry along D (KIVI)
):
    """A ``[BLOCK_N, BLOCK_D]`` fp32 tile of dequantized K or V rows (0 where masked)."""
    rows = block * stride_cb + tok * stride_ct
    mask = n_mask[:, None] & d_mask[None, :]
    if BITS == 8:
        codes = tl.load(codes_ptr + rows[:, None] + offs_d[None, :], mask=mask)  # no `other`: fp8 has no literal
        scale = tl.load(scale_ptr + block * stride_sb + tok * stride_st, mask=n_mask, other=0.0)
        x = tl.where(mask, codes.to(tl.float32), 0.0) * scale[:, None]
    else:
        PER_BYTE: tl.constexpr = 8 // BITS
        packed = tl.load(codes_ptr + rows[:, None] + (offs_d // PER_BYTE)[None, :], mask=mask, other=0)
        shift = ((offs_d % PER_BYTE) * BITS)[None, :]
        codes = ((packed.to(tl.int32) >> shift) & ((1 << BITS) - 1)).to(tl.float32)
        at = (block * stride_sb + tok * stride_st)[:, None] + ((offs_d // SCALE_DIV) * stride_sd)[None, :]
        scale = tl.load(scale_ptr + at, mask=mask, other=0.0).to(tl.float32)
        x = codes * scale + tl.load(zero_ptr + at, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _full_precision_rows(fp_ptr, fp_table_ptr, block, tok, offs_d, n_mask, d_mask, stride_fb, stride_ft):
    """KIVI's full-precision blocks: ``(rows [BLOCK_N, BLOCK_D] fp32, has_row [BLOCK_N])`` for the
    tile's tokens whose block has an entry ``fp_table[block] >= 0`` in ``fp_ptr`` (one KV head)."""
    slot = tl.load(fp_table_ptr + block, mask=n_mask, other=-1).to(tl.int64)
    has = slot >= 0
    rows = tl.where(has, slot, 0) * stride_fb + tok * stride_ft
    x = tl.load(fp_ptr + rows[:, None] + offs_d[None, :], mask=(n_mask & has)[:, None] & d_mask[None, :], other=0.0)
    return x.to(tl.float32), has


@triton.jit
def _exact_rows(
    fp_ptr,
    fp_table_ptr,
    r_ptr,
    r_table_ptr,
    h,
    block,
    tok,
    offs_d,
    n_mask,
    d_mask,
    stride_fb,
    stride_ft,
    stride_fh,
    stride_rb,
    stride_rt,
    stride_rh,
    HAS_RES: tl.constexpr,
):
    """Prefill's full-precision rows: this step's staging first, else (``HAS_RES``) the residual."""
    x, has = _full_precision_rows(
        fp_ptr + h * stride_fh, fp_table_ptr, block, tok, offs_d, n_mask, d_mask, stride_fb, stride_ft
    )
    if HAS_RES:
        r, has_r = _full_precision_rows(
            r_ptr + h * stride_rh, r_table_ptr, block, tok, offs_d, n_mask & ~has, d_mask, stride_rb, stride_rt
        )
        x = tl.where(has[:, None], x, r)
        has = has | has_r
    return x, has


@triton.jit
def _as_operand(x, DTYPE: tl.constexpr, DOT_FP32: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """fp32 ``x`` rounded to the query dtype (what the reference attends over), as a dot operand."""
    x = _round_to(x, DTYPE, EMULATE_RNE)
    if DOT_FP32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr, DOT_PREC: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a, b, input_precision=DOT_PREC)
    return tl.dot(a.to(b.dtype), b)


# ---- decode ------------------------------------------------------------------------------------
@triton.jit
def _quant_decode_kernel(
    q_ptr,  # [num_seqs, num_q_heads, HEAD_DIM]
    kc_ptr,
    ks_ptr,
    kz_ptr,  # key codes / scales / zeros (kz unused for per-token formats)
    vc_ptr,
    vs_ptr,
    vz_ptr,
    fpk_ptr,
    fpv_ptr,
    fp_table_ptr,  # HAS_FP: full-precision blocks [slots, bs, Hkv, D], [num_blocks]
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,  # as _decode_kernel
    scale_log2e,
    partition_size,
    stride_qs,
    stride_qh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_ksb,
    stride_kst,
    stride_ksh,
    stride_ksd,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_vsb,
    stride_vst,
    stride_vsh,
    stride_vsd,
    stride_fb,
    stride_ft,
    stride_fh,
    stride_bt,
    stride_os,
    stride_oh,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_mlw,
    stride_mls,
    stride_mlh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BITS: tl.constexpr,
    K_SCALE_DIV: tl.constexpr,
    V_SCALE_DIV: tl.constexpr,
    HAS_FP: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """``_decode_kernel`` over quantized blocks: one program per (sequence, KV head, partition)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition_size
    if start >= seq_len:
        return
    end = tl.minimum(start + partition_size, seq_len)
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    h = kv_head.to(tl.int64)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok = (pos % BLOCK_SIZE).to(tl.int64)
        k = _dequant_tile(
            kc_ptr + h * stride_kch,
            ks_ptr + h * stride_ksh,
            kz_ptr + h * stride_ksh,
            block,
            tok,
            offs_d,
            n_mask,
            d_mask,
            stride_kcb,
            stride_kct,
            stride_ksb,
            stride_kst,
            stride_ksd,
            BITS,
            K_SCALE_DIV,
        )
        if HAS_FP:  # blocks still open (KIVI's residual) are read in full precision
            fk, has = _full_precision_rows(
                fpk_ptr + h * stride_fh, fp_table_ptr, block, tok, offs_d, n_mask, d_mask, stride_fb, stride_ft
            )
            k = tl.where(has[:, None], fk, k)
        qk = _dot(q, tl.trans(_as_operand(k, DTYPE, DOT_FP32, EMULATE_RNE)), DOT_FP32, DOT_PREC)
        qk = tl.where(n_mask[None, :], qk * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = _dequant_tile(
            vc_ptr + h * stride_vch,
            vs_ptr + h * stride_vsh,
            vz_ptr + h * stride_vsh,
            block,
            tok,
            offs_d,
            n_mask,
            d_mask,
            stride_vcb,
            stride_vct,
            stride_vsb,
            stride_vst,
            stride_vsd,
            BITS,
            V_SCALE_DIV,
        )
        if HAS_FP:
            fv, has = _full_precision_rows(
                fpv_ptr + h * stride_fh, fp_table_ptr, block, tok, offs_d, n_mask, d_mask, stride_fb, stride_ft
            )
            v = tl.where(has[:, None], fv, v)
        acc = acc * alpha[:, None] + _dot(p, _as_operand(v, DTYPE, DOT_FP32, EMULATE_RNE), DOT_FP32, DOT_PREC)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        base = seq.to(tl.int64) * stride_ps + heads * stride_ph + split * stride_pk
        tl.store(part_acc_ptr + base[:, None] + offs_d[None, :], acc, mask=out_mask)
        ml = part_ml_ptr + seq.to(tl.int64) * stride_mls + heads * stride_mlh + split
        tl.store(ml, m_i, mask=g_mask)
        tl.store(ml + stride_mlw, l_i, mask=g_mask)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


# ---- prefill -----------------------------------------------------------------------------------
@triton.jit
def _quant_prefill_tile(
    q,
    m_i,
    l_i,
    acc,
    n0,
    hi,
    q_pos,
    exact_group,
    table_row,
    h,
    kc_ptr,
    ks_ptr,
    kz_ptr,
    vc_ptr,
    vs_ptr,
    vz_ptr,
    fpk_ptr,
    fpv_ptr,
    fp_table_ptr,
    rk_ptr,
    rv_ptr,
    r_table_ptr,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_ksb,
    stride_kst,
    stride_ksh,
    stride_ksd,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_vsb,
    stride_vst,
    stride_vsh,
    stride_vsd,
    stride_fb,
    stride_ft,
    stride_fh,
    stride_rb,
    stride_rt,
    stride_rh,
    scale_log2e,
    DTYPE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BITS: tl.constexpr,
    K_SCALE_DIV: tl.constexpr,
    V_SCALE_DIV: tl.constexpr,
    DIAGONAL: tl.constexpr,  # causal mask, and (with HAS_FP) full-precision tokens of the rows' own windows
    HAS_FP: tl.constexpr,
    HAS_RES: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """One KV tile of the quantized prefill's online softmax; returns the updated (m, l, acc)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    pos = n0 + offs_n
    n_mask = pos < hi
    d_mask = offs_d < HEAD_DIM
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    tok = (pos % BLOCK_SIZE).to(tl.int64)
    k = _dequant_tile(
        kc_ptr + h * stride_kch,
        ks_ptr + h * stride_ksh,
        kz_ptr + h * stride_ksh,
        block,
        tok,
        offs_d,
        n_mask,
        d_mask,
        stride_kcb,
        stride_kct,
        stride_ksb,
        stride_kst,
        stride_ksd,
        BITS,
        K_SCALE_DIV,
    )
    qk = _dot(q, tl.trans(_as_operand(k, DTYPE, DOT_FP32, EMULATE_RNE)), DOT_FP32, DOT_PREC)
    if DIAGONAL and HAS_FP:
        fk, has = _exact_rows(
            fpk_ptr,
            fp_table_ptr,
            rk_ptr,
            r_table_ptr,
            h,
            block,
            tok,
            offs_d,
            n_mask,
            d_mask,
            stride_fb,
            stride_ft,
            stride_fh,
            stride_rb,
            stride_rt,
            stride_rh,
            HAS_RES,
        )
        exact = (exact_group[:, None] == (pos // WINDOW)[None, :]) & has[None, :]
        fk = _as_operand(fk, DTYPE, DOT_FP32, EMULATE_RNE)
        qk = tl.where(exact, _dot(q, tl.trans(fk), DOT_FP32, DOT_PREC), qk)
    qk = qk * scale_log2e
    if DIAGONAL:
        qk = tl.where((pos[None, :] <= q_pos[:, None]) & n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = _dequant_tile(
        vc_ptr + h * stride_vch,
        vs_ptr + h * stride_vsh,
        vz_ptr + h * stride_vsh,
        block,
        tok,
        offs_d,
        n_mask,
        d_mask,
        stride_vcb,
        stride_vct,
        stride_vsb,
        stride_vst,
        stride_vsd,
        BITS,
        V_SCALE_DIV,
    )
    if DIAGONAL and HAS_FP:
        fv, has = _exact_rows(
            fpv_ptr,
            fp_table_ptr,
            rv_ptr,
            r_table_ptr,
            h,
            block,
            tok,
            offs_d,
            n_mask,
            d_mask,
            stride_fb,
            stride_ft,
            stride_fh,
            stride_rb,
            stride_rt,
            stride_rh,
            HAS_RES,
        )
        acc += _dot(tl.where(exact, p, 0.0), _as_operand(fv, DTYPE, DOT_FP32, EMULATE_RNE), DOT_FP32, DOT_PREC)
        p = tl.where(exact, 0.0, p)
    acc += _dot(p, _as_operand(v, DTYPE, DOT_FP32, EMULATE_RNE), DOT_FP32, DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _quant_prefill_kernel(
    q_ptr,  # [num_tokens, num_q_heads, HEAD_DIM]
    kc_ptr,
    ks_ptr,
    kz_ptr,
    vc_ptr,
    vs_ptr,
    vz_ptr,
    fpk_ptr,
    fpv_ptr,
    fp_table_ptr,  # HAS_FP: this step's full-precision blocks (KIVI staging)
    rk_ptr,
    rv_ptr,
    r_table_ptr,  # HAS_RES: blocks in a residual window (read where the staging has none)
    out_ptr,  # [num_tokens, num_q_heads, HEAD_DIM]
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2e,
    num_q_blocks,
    stride_qt,
    stride_qh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_ksb,
    stride_kst,
    stride_ksh,
    stride_ksd,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_vsb,
    stride_vst,
    stride_vsh,
    stride_vsd,
    stride_fb,
    stride_ft,
    stride_fh,
    stride_rb,
    stride_rt,
    stride_rh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BITS: tl.constexpr,
    K_SCALE_DIV: tl.constexpr,
    V_SCALE_DIV: tl.constexpr,
    HAS_FP: tl.constexpr,
    HAS_RES: tl.constexpr,
    WINDOW: tl.constexpr,  # KIVI: tokens of a full-precision window group (a multiple of BLOCK_SIZE)
    DOT_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """Causal attention of query chunks over their sequences' quantized blocks (``_prefill_kernel``
    with PAGED; grid (query block, KV head, sequence)).

    With ``HAS_FP`` (KIVI), query position ``p`` reads the tokens of its own window group
    (``WINDOW`` tokens; the block when the window is the open block) in full precision unless
    ``p`` is the group's last token, i.e. completes it; every other token dequantized. This is
    ``kv_quant.attend_causal_kivi``: what decoding token by token would have seen. Full-precision
    rows come from this step's staging (``fp_table[block]``) or else the residual
    (``r_table[block]``). Tiles that can hold such tokens compute both scores and pick per
    (row, column)."""
    q_block = num_q_blocks - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok_q = q_block * BLOCK_Q + offs_m // BLOCK_G
    g = offs_m % BLOCK_G
    m_mask = (tok_q < q_len) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + g
    q_pos = ctx_len + tok_q
    # KIVI: the window group whose tokens row p reads in full precision (-1: none, p completes it)
    exact_group = tl.where(q_pos % WINDOW == WINDOW - 1, -1, q_pos // WINDOW)

    q_rows = (q_start + tok_q).to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    first_pos = ctx_len + q_block * BLOCK_Q
    hi = ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    if HAS_FP:  # the first row's own window group may hold full-precision tokens
        first_pos = (first_pos // WINDOW) * WINDOW
    plain_end = (first_pos // BLOCK_N) * BLOCK_N
    h = kv_head.to(tl.int64)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Tiles every row sees whole and dequantized: no mask, one score per (row, token).
    for n0 in range(0, plain_end, BLOCK_N):
        m_i, l_i, acc = _quant_prefill_tile(
            q,
            m_i,
            l_i,
            acc,
            n0,
            hi,
            q_pos,
            exact_group,
            table_row,
            h,
            kc_ptr,
            ks_ptr,
            kz_ptr,
            vc_ptr,
            vs_ptr,
            vz_ptr,
            fpk_ptr,
            fpv_ptr,
            fp_table_ptr,
            rk_ptr,
            rv_ptr,
            r_table_ptr,
            stride_kcb,
            stride_kct,
            stride_kch,
            stride_ksb,
            stride_kst,
            stride_ksh,
            stride_ksd,
            stride_vcb,
            stride_vct,
            stride_vch,
            stride_vsb,
            stride_vst,
            stride_vsh,
            stride_vsd,
            stride_fb,
            stride_ft,
            stride_fh,
            stride_rb,
            stride_rt,
            stride_rh,
            scale_log2e,
            q_ptr.dtype.element_ty,
            HEAD_DIM,
            BLOCK_SIZE,
            BLOCK_N,
            BLOCK_D,
            BITS,
            K_SCALE_DIV,
            V_SCALE_DIV,
            False,
            HAS_FP,
            HAS_RES,
            WINDOW,
            DOT_FP32,
            DOT_PREC,
            EMULATE_RNE,
        )
    # Tiles that reach the causal diagonal (or the rows' own blocks).
    for n0 in range(plain_end, hi, BLOCK_N):
        m_i, l_i, acc = _quant_prefill_tile(
            q,
            m_i,
            l_i,
            acc,
            n0,
            hi,
            q_pos,
            exact_group,
            table_row,
            h,
            kc_ptr,
            ks_ptr,
            kz_ptr,
            vc_ptr,
            vs_ptr,
            vz_ptr,
            fpk_ptr,
            fpv_ptr,
            fp_table_ptr,
            rk_ptr,
            rv_ptr,
            r_table_ptr,
            stride_kcb,
            stride_kct,
            stride_kch,
            stride_ksb,
            stride_kst,
            stride_ksh,
            stride_ksd,
            stride_vcb,
            stride_vct,
            stride_vch,
            stride_vsb,
            stride_vst,
            stride_vsh,
            stride_vsd,
            stride_fb,
            stride_ft,
            stride_fh,
            stride_rb,
            stride_rt,
            stride_rh,
            scale_log2e,
            q_ptr.dtype.element_ty,
            HEAD_DIM,
            BLOCK_SIZE,
            BLOCK_N,
            BLOCK_D,
            BITS,
            K_SCALE_DIV,
            V_SCALE_DIV,
            True,
            HAS_FP,
            HAS_RES,
            WINDOW,
            DOT_FP32,
            DOT_PREC,
            EMULATE_RNE,
        )

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = (q_start + tok_q).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(
        out_ptr + o_rows[:, None] + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


# ---- quantize-on-store -------------------------------------------------------------------------
@triton.jit
def _round_half_even(y):
    """fp32 ``y`` (|y| < 2**22) rounded to an integer, ties to even (torch.round)."""
    return (y + RNE_MAGIC) - RNE_MAGIC


@triton.jit
def _fp8_bits(x, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr):
    """fp32 ``x`` -> fp8 code bits (uint8), round to nearest even, saturating at ``MAX_CODE``: bit
    for bit torch's cast for every |x| up to the format's max."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    mag = bits & 0x7FFFFFFF
    DROP: tl.constexpr = 23 - MANT
    rounded = (mag + ((1 << (DROP - 1)) - 1) + ((mag >> DROP) & 1)) >> DROP
    normal = rounded.to(tl.int32) - ((127 - BIAS) << MANT)  # rebias the exponent
    SMALLEST_NORMAL: tl.constexpr = 2.0 ** (1 - BIAS)
    SUBNORMAL_SCALE: tl.constexpr = 2.0 ** (BIAS - 1 + MANT)  # 1 / the subnormal step
    subnormal = _round_half_even(tl.minimum(tl.abs(x), SMALLEST_NORMAL) * SUBNORMAL_SCALE).to(tl.int32)
    code = tl.minimum(tl.where(normal >= (1 << MANT), normal, subnormal), MAX_CODE)
    return (code.to(tl.uint32) | sign).to(tl.uint8)


@triton.jit
def _quantize_rows(x, QMAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_MAX_CODE: tl.constexpr):
    """``[H, D]`` fp32 rows -> (codes, scale [H]) of ``kv_quant.quantize_per_token``; FP8_MANT 0 is
    int8 (codes as int8), else fp8 code bits (uint8)."""
    scale = tl.math.div_rn(tl.max(tl.abs(x), 1), QMAX)
    scaled = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
    if FP8_MANT == 0:
        codes = tl.minimum(tl.maximum(_round_half_even(scaled), -127.0), 127.0).to(tl.int8)
    else:
        codes = _fp8_bits(scaled, FP8_MANT, FP8_BIAS, FP8_MAX_CODE)
    return codes, scale


@triton.jit
def _quant_store_kernel(
    key_ptr,
    value_ptr,  # [num_tokens, Hkv, D]
    kc_ptr,
    ks_ptr,
    vc_ptr,
    vs_ptr,  # codes [blocks, bs, Hkv, D] (fp8 as uint8 bits), scales [blocks, bs, Hkv]
    slot_mapping_ptr,  # [num_tokens], -1 = skip
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_ksb,
    stride_kst,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_vsb,
    stride_vst,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QMAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_MAX_CODE: tl.constexpr,
):
    """One program per token: per-(token, head) scale = amax / QMAX, codes = x / scale."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < NUM_KV_HEADS
    mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    t = token.to(tl.int64)

    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    codes, scale = _quantize_rows(k.to(tl.float32), QMAX, FP8_MANT, FP8_BIAS, FP8_MAX_CODE)
    tl.store(
        kc_ptr + block * stride_kcb + offset * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :],
        codes,
        mask=mask,
    )
    tl.store(ks_ptr + block * stride_ksb + offset * stride_kst + offs_h, scale, mask=h_mask)

    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    codes, scale = _quantize_rows(v.to(tl.float32), QMAX, FP8_MANT, FP8_BIAS, FP8_MAX_CODE)
    tl.store(
        vc_ptr + block * stride_vcb + offset * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :],
        codes,
        mask=mask,
    )
    tl.store(vs_ptr + block * stride_vsb + offset * stride_vst + offs_h, scale, mask=h_mask)


@triton.jit
def _scale_zero(lo, hi, BITS: tl.constexpr):
    """Float16 scale and zero of a group from its min/max, saturating (``kv_quant._minmax_codes``)."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    FMAX: tl.constexpr = 65504.0
    scale = tl.minimum(tl.math.div_rn(hi - lo, LEVELS * 1.0), FMAX).to(tl.float16)
    zero = tl.minimum(tl.maximum(lo, -FMAX), FMAX).to(tl.float16)
    return scale, zero


@triton.jit
def _codes_of(x, scale, zero, BITS: tl.constexpr):
    """Codes of ``x`` in ``[0, 2**BITS - 1]`` from the stored (float16) scale and zero."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    s = scale.to(tl.float32)
    q = _round_half_even(tl.math.div_rn(x - zero.to(tl.float32), tl.where(s > 0, s, 1.0)))
    return tl.minimum(tl.maximum(q, 0.0), LEVELS * 1.0).to(tl.int32)


@triton.jit
def _kivi_finalize_kernel(
    sk_ptr,
    sv_ptr,  # staging [B, bs, Hkv, D] (model dtype): the full-precision blocks of this step
    staging_idx_ptr,
    blocks_ptr,  # [F]: staging index and pool block id of each block to quantize
    kc_ptr,
    ks_ptr,
    kz_ptr,  # keys: packed [blocks, bs, Hkv, D*BITS/8], scale/zero [blocks, Hkv, D] f16
    vc_ptr,
    vs_ptr,
    vz_ptr,  # values: packed likewise, scale/zero [blocks, bs, Hkv, D/GROUP] f16
    stride_sb,
    stride_st,
    stride_sh,  # of the staging (K and V alike)
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_ksb,
    stride_ksh,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_vsb,
    stride_vst,
    stride_vsh,
    BITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,  # BLOCK_SIZE padded to a power of two
    NB_P: tl.constexpr,  # HEAD_DIM / PER_BYTE padded (bytes of a key row)
    NG_P: tl.constexpr,  # HEAD_DIM / GROUP_SIZE padded (value groups)
    GB_P: tl.constexpr,  # GROUP_SIZE / PER_BYTE padded (bytes of a value group)
):
    """KIVI quantization of one completed block and KV head (one program each): keys per channel
    over the block's tokens, values per token over channel groups (``kv_quant.quantize_kivi_*``).
    Tiles are shaped ``[..., byte, code in byte]`` so packing is a sum of shifted codes."""
    PER_BYTE: tl.constexpr = 8 // BITS
    NUM_BYTES: tl.constexpr = HEAD_DIM // PER_BYTE
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    src = tl.load(staging_idx_ptr + i).to(tl.int64) * stride_sb + h * stride_sh
    block = tl.load(blocks_ptr + i).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)
    offs_s = tl.arange(0, PER_BYTE)
    shifts = offs_s * BITS
    t_mask = offs_t < BLOCK_SIZE

    # keys [BLOCK_T, NB_P, PER_BYTE]: channel d = byte * PER_BYTE + s
    offs_b = tl.arange(0, NB_P)
    chan = offs_b[:, None] * PER_BYTE + offs_s[None, :]  # [NB_P, PER_BYTE]
    c_mask = offs_b[:, None] < NUM_BYTES
    mask = t_mask[:, None, None] & c_mask[None, :, :]
    x = tl.load(sk_ptr + src + offs_t[:, None, None] * stride_st + chan[None, :, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    lo = tl.min(tl.where(mask, x, float("inf")), 0)
    hi = tl.max(tl.where(mask, x, float("-inf")), 0)
    scale, zero = _scale_zero(lo, hi, BITS)
    codes = _codes_of(x, scale[None, :, :], zero[None, :, :], BITS)
    packed = tl.sum(codes << shifts[None, None, :], 2).to(tl.uint8)
    k_rows = kc_ptr + block * stride_kcb + h * stride_kch + offs_t[:, None] * stride_kct
    tl.store(k_rows + offs_b[None, :], packed, mask=t_mask[:, None] & (offs_b[None, :] < NUM_BYTES))
    at = block * stride_ksb + h * stride_ksh + chan
    tl.store(ks_ptr + at, scale, mask=c_mask)
    tl.store(kz_ptr + at, zero, mask=c_mask)

    # values [BLOCK_T, NG_P, GB_P, PER_BYTE]: channel d = (group * GB + byte) * PER_BYTE + s
    GB: tl.constexpr = GROUP_SIZE // PER_BYTE
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
    offs_g = tl.arange(0, NG_P)
    offs_gb = tl.arange(0, GB_P)
    byte = offs_g[:, None] * GB + offs_gb[None, :]  # [NG_P, GB_P]
    b_mask = (offs_g[:, None] < NG) & (offs_gb[None, :] < GB)
    chan = byte[:, :, None] * PER_BYTE + offs_s[None, None, :]
    mask = t_mask[:, None, None, None] & b_mask[None, :, :, None]
    x = tl.load(sv_ptr + src + offs_t[:, None, None, None] * stride_st + chan[None, :, :, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    lo = tl.min(tl.min(tl.where(mask, x, float("inf")), 3), 2)  # [BLOCK_T, NG_P]
    hi = tl.max(tl.max(tl.where(mask, x, float("-inf")), 3), 2)
    scale, zero = _scale_zero(lo, hi, BITS)
    codes = _codes_of(x, scale[:, :, None, None], zero[:, :, None, None], BITS)
    packed = tl.sum(codes << shifts[None, None, None, :], 3).to(tl.uint8)  # [BLOCK_T, NG_P, GB_P]
    v_rows = vc_ptr + block * stride_vcb + h * stride_vch + offs_t[:, None, None] * stride_vct
    tl.store(v_rows + byte[None, :, :], packed, mask=t_mask[:, None, None] & b_mask[None, :, :])
    at = block * stride_vsb + h * stride_vsh + offs_t[:, None] * stride_vst + offs_g[None, :]
    g_mask = t_mask[:, None] & (offs_g[None, :] < NG)
    tl.store(vs_ptr + at, scale, mask=g_mask)
    tl.store(vz_ptr + at, zero, mask=g_mask)


# ---- launch arguments --------------------------------------------------------------------------
def cache_operands(cache, kind: str, head_dim: int) -> tuple[list, list[int], dict]:
    """(pointers, strides, constexprs) of one layer's quantized K/V for the attention kernels:
    ``kc, ks, kz, vc, vs, vz`` and their strides in the kernels' order."""
    from llmctl_kernels import kv_quant as kq

    bits = kq.KIVI_BITS.get(kind, 8)
    k, v, ks, vs = cache["k"], cache["v"], cache["k_scale"], cache["v_scale"]
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "codes need a unit stride on head_dim"
    if bits == 8:
        kz, vz = ks, vs  # no zeros: never read
        k_scale_strides = (ks.stride(0), ks.stride(1), ks.stride(2), 0)
        v_scale_strides = (vs.stride(0), vs.stride(1), vs.stride(2), 0)
        k_div, v_div = 1, 1
    else:
        kz, vz = cache["k_zero"], cache["v_zero"]
        assert kz.stride() == ks.stride() and vz.stride() == vs.stride(), "zeros must be laid out like scales"
        k_scale_strides = (ks.stride(0), 0, ks.stride(1), ks.stride(2))  # [blocks, H, D]: no token axis
        v_scale_strides = (vs.stride(0), vs.stride(1), vs.stride(2), vs.stride(3))  # [blocks, bs, H, groups]
        k_div, v_div = 1, head_dim // vs.shape[-1]
    ptrs = [k, ks, kz, v, vs, vz]
    strides = [
        k.stride(0),
        k.stride(1),
        k.stride(2),
        k_scale_strides[0],
        k_scale_strides[1],
        k_scale_strides[2],
        k_scale_strides[3],
        v.stride(0),
        v.stride(1),
        v.stride(2),
        *v_scale_strides[:3],
        v_scale_strides[3],
    ]
    return ptrs, strides, {"BITS": bits, "K_SCALE_DIV": k_div, "V_SCALE_DIV": v_div}


def full_precision_operands(full_precision, like) -> tuple[list, list[int], bool]:
    """(pointers, strides, HAS_FP) of the full-precision blocks ``(k [slots, bs, H, D], v, table
    [num_blocks])``; ``None`` gives placeholders the kernels never read."""
    if full_precision is None:
        return [like, like, like], [0, 0, 0], False
    fk, fv, table = full_precision
    assert fk.stride() == fv.stride() and fk.stride(-1) == 1, "full-precision K and V need one unit-stride layout"
    return [fk, fv, table], [fk.stride(0), fk.stride(1), fk.stride(2)], True
