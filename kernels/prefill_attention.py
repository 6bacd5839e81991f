"""Prefill / extend attention over a paged KV cache.

A variable-length batch of query chunks; chunk ``i`` holds the last ``q_len_i`` tokens of a
sequence whose ``seq_lens[i]`` tokens all sit in the cache already (its cached prefix plus this
chunk). Query ``j`` of the chunk sits at position ``seq_lens[i] - q_len_i + j`` and attends causally
to every cached token up to and including itself. This one shape serves fresh prefill, chunked
prefill and prefix-cache hits alike.

Every entry point takes an optional sliding ``window`` (a query at ``q`` sees the keys ``k`` with
``q - window < k <= q``, transformers' ``sliding_window_overlay``) and an optional attention-logit
``softcap`` (``s = softcap * tanh(q.k * scale / softcap)`` before the mask, as Gemma 2); ``None``
is neither. The torch references also take attention ``sinks`` (gpt-oss: one learned logit per
query head in the softmax denominator, ``decode_attention.masked_attention``); the Triton kernels
do not, and their callers hand such layers to these references (llmctl/layers/triton_ops.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from llmctl_kernels.decode_attention import gather_kv, masked_attention, window_mask


def paged_prefill_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        keys = gather_kv(key_cache, block_tables[i : i + 1], seq_len)[0].to(query.dtype)  # [L, Hkv, D]
        values = gather_kv(value_cache, block_tables[i : i + 1], seq_len)[0].to(query.dtype)
        out[q_start:q_end] = attend_causal(query[q_start:q_end], keys, values, scale, window, softcap, sinks)
    return out


def attend_causal(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the last ``len(query)`` positions over ``len(keys)`` positions, within
    a sliding ``window``, with a logit ``softcap`` and attention ``sinks`` ``[Hq]`` when given
    (module docstring).

    query ``[q_len, Hq, D]``, keys/values ``[kv_len, Hkv, D]`` -> ``[q_len, Hq, D]``.
    """
    q_len, kv_len = query.shape[0], keys.shape[0]
    gqa = query.shape[1] != keys.shape[1]
    # 4-D [1, H, L, D] inputs: torch's CPU flash kernel takes them (GQA included); 3-D ones fall back
    # to the much slower math path.
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, keys, values))
    if window is not None or softcap is not None or sinks is not None:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
        mask = window_mask(q_pos, torch.arange(kv_len, device=query.device)[None, :], window)
        return masked_attention(q, k, v, mask, scale, softcap, sinks)[0].transpose(0, 1)
    if q_len == kv_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
        kv_pos = torch.arange(kv_len, device=query.device)
        mask = kv_pos[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


# ---------------------------------------------------------------------------------------------
# Triton: one program per (query block, KV head, sequence). A program's BLOCK_M rows are
# (query token, head) pairs of one GQA group — BLOCK_M // BLOCK_G tokens x BLOCK_G heads — so a
# K/V tile is loaded once per group. It walks its sequence's KV through the block table in
# BLOCK_N-token tiles, unmasked up to the block's first query position, causally masked after.

LOG2E = 1.4426950408889634


def _prefill_config(head_dim: int, group: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_G, BLOCK_M, BLOCK_N, num_warps, num_stages) for a head size, GQA group and dtype."""
    from llmctl_kernels._triton_utils import interpreting, next_pow2

    block_g = next_pow2(group)
    block_d = max(16, next_pow2(head_dim))
    if interpreting():
        block_m, block_n, warps, stages = 32, 32, 4, 1
    elif dtype == torch.float32:  # fp32 operands (tf32x3 dots) take twice the registers and smem
        block_m, block_n, warps, stages = 16, (32 if block_d <= 128 else 16), 4, 1
    elif block_d <= 64:
        block_m, block_n, warps, stages = 128, 64, 4, 2
    elif block_d <= 128:
        block_m, block_n, warps, stages = 128, 64, 8, 2
    else:
        block_m, block_n, warps, stages = 64, 32, 8, 2
    return block_g, max(block_m, block_g, 16), block_n, warps, stages


def _launch_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_tables: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor | None,
    scale: float,
    max_query_len: int | None,
    block_m: int | None,
    block_n: int | None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    from llmctl_kernels import _triton_attention as tk
    from llmctl_kernels._triton_utils import (
        cdiv,
        dots_in_fp32,
        fp32_dot_precision,
        last_dim_contiguous,
        next_pow2,
    )

    num_tokens, num_q_heads, head_dim = query.shape
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs <= 0:
        return out
    paged = block_tables is not None
    num_kv_heads = key.shape[-2]
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "K/V need a unit stride on head_dim"
    group = num_q_heads // num_kv_heads
    query = last_dim_contiguous(query)
    if max_query_len is None:
        if query_start_loc.device.type == "cpu":
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        else:  # a sync-free bound: programs past a chunk's end return at once
            max_query_len = num_tokens
    max_query_len = max(int(max_query_len), 1)

    block_g, cfg_m, cfg_n, num_warps, num_stages = _prefill_config(head_dim, group, query.dtype)
    block_m = max(next_pow2(block_m), block_g, 16) if block_m else cfg_m
    block_n = max(next_pow2(block_n), 16) if block_n else cfg_n
    num_q_blocks = cdiv(max_query_len, block_m // block_g)

    if paged:
        block_tables = last_dim_contiguous(block_tables)
        block_size = key.shape[1]
        strides_k = (key.stride(0), key.stride(1), key.stride(2))
        strides_v = (value.stride(0), value.stride(1), value.stride(2))
        table_stride = block_tables.stride(0)
    else:
        block_tables, seq_lens, block_size = query_start_loc, query_start_loc, 1  # unused
        strides_k = (0, key.stride(0), key.stride(1))
        strides_v = (0, value.stride(0), value.stride(1))
        table_stride = 0

    tk._prefill_kernel[(num_q_blocks, num_kv_heads, num_seqs)](
        query,
        key,
        value,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        float(scale) * LOG2E,
        num_q_blocks,
        query.stride(0),
        query.stride(1),
        *strides_k,
        *strides_v,
        table_stride,
        out.stride(0),
        out.stride(1),
        int(window or 0),
        float(softcap or 0.0) * LOG2E,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=block_g,
        BLOCK_M=block_m,
        BLOCK_Q=block_m // block_g,
        BLOCK_N=block_n,
        BLOCK_D=max(16, next_pow2(head_dim)),
        PAGED=paged,
        DOT_FP32=dots_in_fp32(query.dtype),
        DOT_PREC=fp32_dot_precision(),
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def paged_prefill_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    max_query_len: int | None = None,  # host-side longest chunk (a bound is fine)
    block_m: int | None = None,  # force the tiles (tests)
    block_n: int | None = None,
    window: int | None = None,  # sliding window (module docstring)
    softcap: float | None = None,  # attention-logit soft cap
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    return _launch_prefill(
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        max_query_len,
        block_m,
        block_n,
        window,
        softcap,
    )


def varlen_causal_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    *,
    max_query_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Fresh prefill: each chunk attends causally to itself only, K/V read straight from this
    step's contiguous keys/values (the same kernel as the paged path, without the gather).
    The torch counterpart is ``attend_causal`` per chunk."""
    return _launch_prefill(
        query, key, value, None, query_start_loc, None, scale, max_query_len, block_m, block_n, window, softcap
    )


def paged_prefill_attention_quantized_triton(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    cache: Mapping[str, torch.Tensor],  # one layer's quantized K/V (llmctl/engine/kv_cache.py names and layouts)
    kind: str,  # the --kv-cache-dtype of ``cache`` (not "auto")
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    full_precision: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    residual: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    max_query_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """``paged_prefill_attention_triton`` over quantized blocks, dequantized inside the kernel.

    KIVI passes ``full_precision = (k, v, table)``, this step's staging (``table[block]`` = its
    staging index, -1 none), and optionally ``residual = (k, v, residual_table)`` for blocks the
    staging lacks: position ``p`` reads the tokens of its window group (``window`` tokens, default
    the block) in full precision, from the staging or else the residual, unless ``p`` completes
    the group (``kv_quant.attend_causal_kivi``)."""
    from llmctl_kernels import _triton_kv_quant as tq
    from llmctl_kernels._triton_utils import (
        cdiv,
        dots_in_fp32,
        fp32_dot_precision,
        interpreting,
        last_dim_contiguous,
        next_pow2,
    )

    num_tokens, num_q_heads, head_dim = query.shape
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs <= 0:
        return out
    _, block_size, num_kv_heads, _ = cache["k"].shape
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    group = num_q_heads // num_kv_heads
    query, block_tables = last_dim_contiguous(query), last_dim_contiguous(block_tables)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_g, cfg_m, cfg_n, num_warps, num_stages = _prefill_config(head_dim, group, query.dtype)
    if full_precision is not None and not interpreting():  # KIVI's diagonal tiles hold 4 dots: no spills
        cfg_m, cfg_n = max(cfg_m // (2 if residual is None else 4), block_g, 16), max(cfg_n // 4, 16)
    block_m = max(next_pow2(block_m), block_g, 16) if block_m else cfg_m
    block_n = max(next_pow2(block_n), 16) if block_n else cfg_n
    num_q_blocks = cdiv(max(int(max_query_len), 1), block_m // block_g)
    ptrs, strides, formats = tq.cache_operands(cache, kind, head_dim)
    fp_ptrs, fp_strides, has_fp = tq.full_precision_operands(full_precision, query)
    res_ptrs, res_strides, has_res = tq.full_precision_operands(residual, query)
    window = window or block_size
    assert window % block_size == 0, "a window group is whole blocks"
    tq._quant_prefill_kernel[(num_q_blocks, num_kv_heads, num_seqs)](
        query,
        *ptrs,
        *fp_ptrs,
        *res_ptrs,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        float(scale) * LOG2E,
        num_q_blocks,
        query.stride(0),
        query.stride(1),
        *strides,
        *fp_strides,
        *res_strides,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=block_g,
        BLOCK_M=block_m,
        BLOCK_Q=block_m // block_g,
        BLOCK_N=block_n,
        BLOCK_D=max(16, next_pow2(head_dim)),
        **formats,
        HAS_FP=has_fp,
        HAS_RES=has_res,
        WINDOW=window,
        DOT_FP32=dots_in_fp32(query.dtype),
        DOT_PREC=fp32_dot_precision(),
        EMULATE_RNE=interpreting(),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
