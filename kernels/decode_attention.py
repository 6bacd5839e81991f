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


def paged_decode_attention_torch(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    num_seqs, num_q_heads, head_dim = query.shape
    if num_seqs == 0:
        return torch.empty_like(query)
    max_len = int(seq_lens.max())
    keys = gather_kv(key_cache, block_tables, max_len).transpose(1, 2).to(query.dtype)  # [S, Hkv, L, D]
    values = gather_kv(value_cache, block_tables, max_len).transpose(1, 2).to(query.dtype)
    positions = torch.arange(max_len, device=query.device)
    mask = (positions[None, :] < seq_lens[:, None].to(positions.dtype))[:, None, None, :]  # [S, 1, 1, L]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [S, Hq, 1, D]
        keys,
        values,
        attn_mask=mask,
        scale=scale,
        enable_gqa=num_q_heads != keys.shape[1],
    )
    return out.squeeze(2)


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
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_FP32=dots_in_fp32(query.dtype),
        DOT_PREC=fp32_dot_precision(),
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
