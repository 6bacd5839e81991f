"""Triton attention kernels over the paged KV cache (imported lazily by the ``*_triton`` wrappers).

Layouts follow docs/kernels.md: caches ``[num_blocks, block_size, num_kv_heads, head_dim]``
with a unit stride on ``head_dim``. Every kernel works in the log2 domain (``qk * scale * log2(e)``
then ``exp2``), keeps the online-softmax state and the output accumulator in fp32, and gathers KV
rows token by token through the block table (``block = table[pos // BLOCK_SIZE]``), so a KV tile
may span any number of pages and pages may sit anywhere in the pool.

``DOT_FP32`` (constexpr) upcasts ``tl.dot`` operands to fp32, multiplied at ``DOT_PREC``: it is on
for fp32 inputs and always under the interpreter (which mis-multiplies bf16). On a GPU fp32 dots
use ``tf32x3`` (three TF32 tensor-core products: fp32-level accuracy, no silent TF32 rounding, and
none of the register spills of the FMA-based ``ieee`` path); with bf16/fp16 the tensor cores take
native operands and accumulate in fp32.

``HAS_WINDOW`` (constexpr) adds a sliding window of ``window`` tokens (a query at ``q`` sees the
keys ``k`` with ``q - window < k <= q``); ``HAS_SOFTCAP`` soft-caps every score before the mask,
``softcap * tanh(s / softcap)``, computed in the log2 domain with the cap times log2(e). Both off
compile to the kernels without them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _softcap(x, cap):
    """``cap * tanh(x / cap)``, from one exp2 of a non-positive argument (no overflow)."""
    y = x / cap
    e = tl.exp2(tl.abs(y) * -2.8853900817779268)  # exp(-2|y|)
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(y < 0, -t, t)


@triton.jit
def _decode_kernel(
    q_ptr,  # [num_seqs, num_q_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks]
    seq_lens_ptr,  # [num_seqs]
    out_ptr,  # [num_seqs, num_q_heads, HEAD_DIM] (written when not SPLIT)
    part_acc_ptr,  # [num_seqs, num_q_heads, num_splits, HEAD_DIM] fp32 (written when SPLIT)
    part_ml_ptr,  # [2, num_seqs, num_q_heads, num_splits] fp32: running max (log2 units), sum
    scale_log2e,
    partition_size,  # KV tokens per split (a multiple of BLOCK_N)
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_os,
    stride_oh,
    stride_ps,
    stride_ph,
    stride_pk,  # of part_acc
    stride_mlw,
    stride_mls,
    stride_mlh,  # of part_ml (unit stride over splits)
    window,  # sliding window in tokens (HAS_WINDOW)
    softcap_log2,  # soft cap times log2(e) (HAS_SOFTCAP)
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # page size of the cache
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's M)
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
    BLOCK_N: tl.constexpr,  # KV tokens per tile
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition_size
    if start >= seq_len:  # an empty partition of a shorter sequence: the reduction skips it
        return
    end = tl.minimum(start + partition_size, seq_len)
    if HAS_WINDOW:  # a partition wholly before the window stays empty: m = -inf, l = 0 for the merge
        start = tl.maximum(start, seq_len - window)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g

    q_ptrs = q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok = (pos % BLOCK_SIZE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_head + block[:, None] * stride_kb + tok[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0
        )
        k = k.to(q_ptr.dtype.element_ty)  # the reference casts the cache to the query dtype
        if DOT_FP32:
            qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=DOT_PREC)
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * scale_log2e
        if HAS_SOFTCAP:
            qk = _softcap(qk, softcap_log2)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))  # [BLOCK_G, BLOCK_N]

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(
            v_head + block[:, None] * stride_vb + tok[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0
        )
        v = v.to(q_ptr.dtype.element_ty)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision=DOT_PREC)
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        base = seq.to(tl.int64) * stride_ps + heads * stride_ph + split * stride_pk  # [BLOCK_G]
        tl.store(part_acc_ptr + base[:, None] + offs_d[None, :], acc, mask=out_mask)
        ml = part_ml_ptr + seq.to(tl.int64) * stride_mls + heads * stride_mlh + split
        tl.store(ml, m_i, mask=g_mask)
        tl.store(ml + stride_mlw, l_i, mask=g_mask)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [num_seqs, num_q_heads, HEAD_DIM]
    part_acc_ptr,  # [num_seqs, num_q_heads, num_splits, HEAD_DIM] fp32
    part_ml_ptr,  # [2, num_seqs, num_q_heads, num_splits] fp32
    seq_lens_ptr,
    partition_size,
    stride_os,
    stride_oh,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_mlw,
    stride_mls,
    stride_mlh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    """Flash-decoding's second pass: merge the per-partition softmax states of one (seq, head)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, partition_size)

    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_parts
    d_mask = offs_d < HEAD_DIM

    base = seq.to(tl.int64) * stride_ps + head.to(tl.int64) * stride_ph + offs_s * stride_pk  # [BLOCK_SPLITS]
    ml = part_ml_ptr + seq.to(tl.int64) * stride_mls + head.to(tl.int64) * stride_mlh + offs_s
    m = tl.load(ml, mask=s_mask, other=float("-inf"))
    l_parts = tl.load(ml + stride_mlw, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(s_mask, tl.exp2(m - m_max), 0.0)
    denom = tl.sum(l_parts * w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    acc = tl.load(part_acc_ptr + base[:, None] + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / denom
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_os + head.to(tl.int64) * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill_tile(
    q_ptr,
    q,
    m_i,
    l_i,
    acc,
    n0,
    hi,
    q_pos,
    q_start,
    table_row,
    k_head,
    v_head,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    scale_log2e,
    window,
    softcap_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """One KV tile of the prefill kernel's online softmax; returns the updated (m, l, acc)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    pos = n0 + offs_n
    n_mask = pos < hi
    d_mask = offs_d < HEAD_DIM
    if PAGED:
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok_in_block = (pos % BLOCK_SIZE).to(tl.int64)
        k_rows = block * stride_kb + tok_in_block * stride_kt
        v_rows = block * stride_vb + tok_in_block * stride_vt
    else:
        k_rows = (q_start + pos).to(tl.int64) * stride_kt
        v_rows = (q_start + pos).to(tl.int64) * stride_vt
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_head + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    k = k.to(q_ptr.dtype.element_ty)  # the reference casts the cache to the query dtype
    if DOT_FP32:
        qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=DOT_PREC)
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * scale_log2e
    if HAS_SOFTCAP:
        qk = _softcap(qk, softcap_log2)
    if CAUSAL_MASK:
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if HAS_WINDOW:  # a row may see nothing of this tile yet (its window starts later): no NaN from -inf - -inf
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    v = tl.load(v_head + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = v.to(q_ptr.dtype.element_ty)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision=DOT_PREC)
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_q_heads, HEAD_DIM]
    k_ptr,  # PAGED: key cache [num_blocks, BLOCK_SIZE, Hkv, D]; else this step's keys [num_tokens, Hkv, D]
    v_ptr,
    out_ptr,  # [num_tokens, num_q_heads, HEAD_DIM]
    block_tables_ptr,  # [num_seqs, max_blocks] (PAGED only)
    query_start_loc_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs] (PAGED only; else the context is the chunk itself)
    scale_log2e,
    num_q_blocks,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,  # stride_kb unused when not PAGED
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    window,  # sliding window in tokens (HAS_WINDOW)
    softcap_log2,  # soft cap times log2(e) (HAS_SOFTCAP)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q query tokens x BLOCK_G heads of one group
    BLOCK_Q: tl.constexpr,  # BLOCK_M // BLOCK_G
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """Causal attention of a chunk of query tokens over its sequence's whole context.

    Rows of a program are (token, head) pairs of one GQA group, so every K/V tile is loaded once
    for the group's query heads. KV tiles entirely before the block's first query position need
    no mask; only the tiles that reach the causal diagonal are masked.
    """
    q_block = num_q_blocks - 1 - tl.program_id(0)  # longest (latest) blocks first
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    if PAGED:
        seq_len = tl.load(seq_lens_ptr + seq)
    else:
        seq_len = q_len
    ctx_len = seq_len - q_len  # tokens cached before this chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = q_block * BLOCK_Q + offs_m // BLOCK_G  # query index inside the chunk
    g = offs_m % BLOCK_G
    m_mask = (tok < q_len) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + g
    q_pos = ctx_len + tok  # absolute positions of the rows

    q_rows = (q_start + tok).to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    first_pos = ctx_len + q_block * BLOCK_Q  # every row sees all of [0, first_pos]
    hi = ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)  # no row sees [hi, ...)
    full_end = (first_pos // BLOCK_N) * BLOCK_N

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    if HAS_WINDOW:
        # From the tile of the first row's first key on, every tile masked (causal and window).
        window_start = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
        for n0 in range(window_start, hi, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q_ptr,
                q,
                m_i,
                l_i,
                acc,
                n0,
                hi,
                q_pos,
                q_start,
                table_row,
                k_head,
                v_head,
                stride_kb,
                stride_kt,
                stride_vb,
                stride_vt,
                scale_log2e,
                window,
                softcap_log2,
                HEAD_DIM,
                BLOCK_SIZE,
                BLOCK_N,
                BLOCK_D,
                PAGED,
                DOT_FP32,
                DOT_PREC,
                True,
                HAS_WINDOW,
                HAS_SOFTCAP,
            )
    else:
        # Tiles wholly before the first query position: visible to every row, no mask.
        for n0 in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q_ptr,
                q,
                m_i,
                l_i,
                acc,
                n0,
                hi,
                q_pos,
                q_start,
                table_row,
                k_head,
                v_head,
                stride_kb,
                stride_kt,
                stride_vb,
                stride_vt,
                scale_log2e,
                window,
                softcap_log2,
                HEAD_DIM,
                BLOCK_SIZE,
                BLOCK_N,
                BLOCK_D,
                PAGED,
                DOT_FP32,
                DOT_PREC,
                False,
                HAS_WINDOW,
                HAS_SOFTCAP,
            )
        # Tiles that reach the causal diagonal.
        for n0 in range(full_end, hi, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q_ptr,
                q,
                m_i,
                l_i,
                acc,
                n0,
                hi,
                q_pos,
                q_start,
                table_row,
                k_head,
                v_head,
                stride_kb,
                stride_kt,
                stride_vb,
                stride_vt,
                scale_log2e,
                window,
                softcap_log2,
                HEAD_DIM,
                BLOCK_SIZE,
                BLOCK_N,
                BLOCK_D,
                PAGED,
                DOT_FP32,
                DOT_PREC,
                True,
                HAS_WINDOW,
                HAS_SOFTCAP,
            )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(
        out_ptr + o_rows[:, None] + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )
