"""Paged decode attention: one query token per sequence against its paged KV context."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """Gather ``[num_seqs, max_len, num_kv_heads, head_dim]`` from a paged cache (rows past a
    sequence's length hold other blocks' data and must be masked by the caller)."""
    num_seqs = block_tables.shape[0]
    block_size = cache.shape[1]
    num_blocks = (max_len + block_size - 1) // block_size
    # index_select on whole blocks is a row memcpy: about 3x faster on CPU than advanced indexing.
    rows = cache.view(cache.shape[0], -1).index_select(0, block_tables[:, :num_blocks].reshape(-1).long())
    return rows.view(num_seqs, num_blocks * block_size, *cache.shape[2:])[:, :max_len]


def masked_attention(
    query: torch.Tensor,  # [..., Hq, Lq, D]
    keys: torch.Tensor,  # [..., Hkv, L, D]
    values: torch.Tensor,
    mask: torch.Tensor,  # bool, broadcastable to [..., Hq, Lq, L]: True = attend
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]: a learned logit per head in the softmax denominator
) -> torch.Tensor:  # [..., Hq, Lq, D]
    """Attention under a boolean mask; with ``softcap`` each score ``s = q.k * scale`` becomes
    ``softcap * tanh(s / softcap)`` before the mask, as transformers' Gemma 2 eager attention
    computes it (SDPA has no such hook, so that path is written out).

    ``sinks`` (gpt-oss): head ``h``'s softmax runs over its scores and one more logit,
    ``sinks[h]``, which takes its share of the probability mass but contributes no value (the
    rows' weights sum to less than 1), as transformers' gpt-oss eager attention computes it: the
    sink joined to the masked scores, the softmax in fp32, the sink's column dropped."""
    gqa = query.shape[-3] != keys.shape[-3]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        group = query.shape[-3] // keys.shape[-3]
        keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(probs, values)
    sink = sinks.to(torch.float32).view(-1, 1, 1).expand(*scores.shape[:-1], 1)  # [..., Hq, Lq, 1]
    combined = torch.cat([scores.to(torch.float32), sink], dim=-1)
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(query.dtype)  # the sink's column dropped
    return torch.matmul(probs, values)


def window_mask(q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal mask ``[..., Lq, L]`` of queries at ``q_pos [..., Lq, 1]`` over keys at ``kv_pos [1, L]``,
    with a sliding window as transformers' ``sliding_window_overlay``: a query at ``q`` sees the keys
    ``k`` with ``q - window < k <= q`` (``window`` keys, itself included)."""
    mask = kv_pos <= q_pos
    if window is not None:
        mask = mask & (kv_pos > q_pos - window)
    return mask


def paged_decode_attention_torch(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    window: int | None = None,  # sliding window: the last ``window`` tokens (``window_mask``)
    softcap: float | None = None,  # attention-logit soft cap (``masked_attention``)
    sinks: torch.Tensor | None = None,  # [Hq] attention sinks (``masked_attention``)
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    num_seqs, num_q_heads, head_dim = query.shape
    if num_seqs == 0:
        return torch.empty_like(query)
    max_len = int(seq_lens.max())
    keys = gather_kv(key_cache, block_tables, max_len).transpose(1, 2).to(query.dtype)  # [S, Hkv, L, D]
    values = gather_kv(value_cache, block_tables, max_len).transpose(1, 2).to(query.dtype)
    return decode_attention_gathered(query, keys, values, seq_lens, scale, window, softcap, sinks)


def decode_attention_gathered(
    query: torch.Tensor,  # [S, Hq, D]
    keys: torch.Tensor,  # [S, Hkv, L, D]
    values: torch.Tensor,
    seq_lens: torch.Tensor,  # [S]
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [S, Hq, D]
    """One query per sequence, at position ``seq_len - 1``, over its gathered keys/values."""
    positions = torch.arange(keys.shape[2], device=query.device)
    lens = seq_lens[:, None].to(positions.dtype)
    mask = window_mask(lens - 1, positions[None, :], window)[:, None, None, :]  # [S, 1, 1, L]
    if window is None and softcap is None and sinks is None:  # the plain path, exactly as before
        mask = (positions[None, :] < lens)[:, None, None, :]
    return masked_attention(query.unsqueeze(2), keys, values, mask, scale, softcap, sinks).squeeze(2)


# ---------------------------------------------------------------------------------------------
# Triton: one program per (sequence, KV head, context partition). The program holds all query
# heads of its GQA group ([BLOCK_G >= 16, BLOCK_D] rows for tl.dot), so each K/V tile is read
# once per group; an online softmax runs over BLOCK_N-token tiles gathered through the block
# table. With split-K (flash-decoding) each partition writes its unnormalised accumulator and
# softmax state, and a second kernel merges the partitions of every (sequence, query head).

DECODE_MIN_PARTITION = 256  # tokens: shorter partitions cost more in the merge than they win
DECODE_MAX_SPLITS = 64


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split-K heuristic: split the context only when (sequence, KV head) programs alone fill
    fewer than two waves of the GPU, into at most enough partitions to fill them, each at least
    ``DECODE_MIN_PARTITION`` tokens long."""
    from llmctl_kernels._triton_utils import cdiv

    programs = max(num_seqs * num_kv_heads, 1)
    target = 2 * num_sms
    if programs >= target:
        return 1
    max_useful = max(1, cdiv(max_seq_len, DECODE_MIN_PARTITION))
    return max(1, min(cdiv(target, programs), max_useful, DECODE_MAX_SPLITS))


def paged_decode_attention_triton(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    max_seq_len: int | None = None,  # host-side max(seq_lens); computed (one sync) when absent
    num_splits: int | None = None,  # force the number of context partitions (tests, benchmarks)
    block_n: int | None = None,  # force the KV tile (tests)
    window: int | None = None,  # sliding window: the last ``window`` tokens (``window_mask``)
    softcap: float | None = None,  # attention-logit soft cap (``masked_attention``)
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    from llmctl_kernels import _triton_attention as tk
    from llmctl_kernels._triton_utils import dots_in_fp32, fp32_dot_precision, last_dim_contiguous, next_pow2

    num_seqs, num_q_heads, head_dim = query.shape
    out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    _, block_size, num_kv_heads, _ = key_cache.shape
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "caches need a unit stride on head_dim"
    group = num_q_heads // num_kv_heads
    query = last_dim_contiguous(query)
    block_tables = last_dim_contiguous(block_tables)
    block_d = max(16, next_pow2(head_dim))
    block_g = max(16, next_pow2(group))
    block_n, split, num_splits, partition_size, part_acc, part_ml = _decode_partitions(
        query, out, num_kv_heads, seq_lens, max_seq_len, num_splits, block_n
    )
    tk._decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_ml,
        float(scale) * LOG2E,
        partition_size,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        part_acc.stride(0),
        part_acc.stride(1),
        part_acc.stride(2),
        part_ml.stride(0),
        part_ml.stride(1),
        part_ml.stride(2),
        int(window or 0),
        float(softcap or 0.0) * LOG2E,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_FP32=dots_in_fp32(query.dtype),
        DOT_PREC=fp32_dot_precision(),
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        num_warps=4,
        num_stages=2,
    )
    if split:
        _merge_partitions(out, part_acc, part_ml, seq_lens, partition_size, num_splits)
    return out


def _decode_partitions(query, out, num_kv_heads, seq_lens, max_seq_len, num_splits, block_n):
    """Split-K plan of a decode launch: ``(block_n, split, num_splits, partition_size, part_acc,
    part_ml)`` (the partial buffers are placeholders when there is one partition)."""
    from llmctl_kernels._triton_utils import cdiv, interpreting, next_pow2, num_sms

    num_seqs, num_q_heads, head_dim = query.shape
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    max_seq_len = max(int(max_seq_len), 1)
    block_d = max(16, next_pow2(head_dim))
    if block_n is None:
        block_n = 64 if interpreting() or (block_d <= 128 and query.dtype != torch.float32) else 32
    block_n = max(16, next_pow2(block_n))
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms(query.device))
    num_splits = max(1, min(int(num_splits), cdiv(max_seq_len, block_n)))
    partition_size = cdiv(cdiv(max_seq_len, num_splits), block_n) * block_n
    num_splits = cdiv(max_seq_len, partition_size)
    split = num_splits > 1
    if not split:
        partition_size = 1 << 30  # one program covers any length, even past a stale max_seq_len
        part_acc = out  # unused placeholders
        part_ml = torch.empty((2, 1, 1, 1), dtype=torch.float32, device=query.device)
    else:
        part_acc = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((2, num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=query.device)
    return block_n, split, num_splits, partition_size, part_acc, part_ml


def _merge_partitions(out, part_acc, part_ml, seq_lens, partition_size, num_splits) -> None:
    """Flash-decoding's second pass over the partitions of every (sequence, query head)."""
    from llmctl_kernels import _triton_attention as tk
    from llmctl_kernels._triton_utils import next_pow2

    num_seqs, num_q_heads, head_dim = out.shape
    tk._decode_reduce_kernel[(num_seqs, num_q_heads)](
        out,
        part_acc,
        part_ml,
        seq_lens,
        partition_size,
        out.stride(0),
        out.stride(1),
        part_acc.stride(0),
        part_acc.stride(1),
        part_acc.stride(2),
        part_ml.stride(0),
        part_ml.stride(1),
        part_ml.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_SPLITS=max(2, next_pow2(num_splits)),
        num_warps=4,
    )


def paged_decode_attention_quantized_triton(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    cache: Mapping[str, torch.Tensor],  # one layer's quantized K/V (llmctl/engine/kv_cache.py names and layouts)
    kind: str,  # the --kv-cache-dtype of ``cache`` (not "auto")
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    full_precision: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """``paged_decode_attention_triton`` over quantized blocks, dequantized inside the kernel.
    ``full_precision = (k, v, table)``: a block with ``table[block] >= 0`` is read from
    ``k/v[table[block]]`` (``[slots, block_size, Hkv, D]``) instead of its codes (KIVI's open
    blocks: the residual pool and ``residual_table``). The torch counterpart is
    ``QuantizedLayerKV.gather`` + ``kv_quant.decode_attention_dense``."""
    from llmctl_kernels import _triton_kv_quant as tq
    from llmctl_kernels._triton_utils import (
        dots_in_fp32,
        fp32_dot_precision,
        interpreting,
        last_dim_contiguous,
        next_pow2,
    )

    num_seqs, num_q_heads, head_dim = query.shape
    out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    _, block_size, num_kv_heads, _ = cache["k"].shape
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    group = num_q_heads // num_kv_heads
    query, block_tables = last_dim_contiguous(query), last_dim_contiguous(block_tables)
    ptrs, strides, formats = tq.cache_operands(cache, kind, head_dim)
    fp_ptrs, fp_strides, has_fp = tq.full_precision_operands(full_precision, query)
    block_n, split, num_splits, partition_size, part_acc, part_ml = _decode_partitions(
        query, out, num_kv_heads, seq_lens, max_seq_len, num_splits, block_n
    )
    tq._quant_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        *ptrs,
        *fp_ptrs,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_ml,
        float(scale) * LOG2E,
        partition_size,
        query.stride(0),
        query.stride(1),
        *strides,
        *fp_strides,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        part_acc.stride(0),
        part_acc.stride(1),
        part_acc.stride(2),
        part_ml.stride(0),
        part_ml.stride(1),
        part_ml.stride(2),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, next_pow2(group)),
        BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_N=block_n,
        **formats,
        HAS_FP=has_fp,
        SPLIT=split,
        DOT_FP32=dots_in_fp32(query.dtype),
        DOT_PREC=fp32_dot_precision(),
        EMULATE_RNE=interpreting(),
        num_warps=4,
        num_stages=2,
    )
    if split:
        _merge_partitions(out, part_acc, part_ml, seq_lens, partition_size, num_splits)
    return out


LOG2E = 1.4426950408889634
