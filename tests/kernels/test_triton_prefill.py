"""Prefill / extend attention over the paged KV: the Triton kernel against the torch reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_testing import DEVICE, assert_close, make_paged_kv

from llmctl_kernels.prefill_attention import (
    attend_causal,
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
    varlen_causal_attention_triton,
)


def _run(q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, block_m=None, block_n=None):
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    key_cache, value_cache, tables = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim).to(dtype).to(DEVICE)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    expected = paged_prefill_attention_torch(query, key_cache, value_cache, tables, qsl, lens, scale)
    actual = paged_prefill_attention_triton(
        query, key_cache, value_cache, tables, qsl, lens, scale, block_m=block_m, block_n=block_n
    )
    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("with_prefix", [False, True], ids=["fresh", "prefix"])
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads",
    [(2, 2), (4, 2), (4, 1), (8, 2), (8, 1), (6, 2)],
    ids=["mha", "gqa2", "mqa4", "gqa4", "mqa8", "gqa3"],
)
def test_prefill_gqa_ratios(num_q_heads, num_kv_heads, with_prefix):
    q_lens = [7, 21, 1]
    ctx_lens = [19, 40, 5] if with_prefix else [0, 0, 0]
    _run(q_lens, ctx_lens, num_q_heads, num_kv_heads, 32, 16, torch.float32, block_m=16, block_n=16)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_prefill_dtypes_and_shapes(dtype, head_dim, block_size):
    _run([9, 30], [0, 35], 4, 2, head_dim, block_size, dtype)


@pytest.mark.parametrize(
    "q_lens,ctx_lens",
    [
        ([1], [0]),  # a single token from empty
        ([16, 17, 15], [16, 0, 1]),  # chunk and prefix edges on block boundaries
        ([3, 0, 5], [10, 4, 0]),  # an empty chunk in the middle of the batch
        ([2, 40], [70, 3]),  # a long prefix with a short chunk, a long chunk with a short prefix
        ([1, 1, 1], [1, 31, 64]),  # decode-shaped chunks through the prefill kernel
    ],
    ids=["single", "edges", "empty-chunk", "long-prefix", "decode-shaped"],
)
@pytest.mark.parametrize("tiles", [(16, 16), (None, None)], ids=["tiles16", "default"])
def test_prefill_varlen_batches(q_lens, ctx_lens, tiles):
    _run(q_lens, ctx_lens, 4, 1, 16, 16, torch.float32, *tiles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (4, 1), (8, 2)], ids=["mha", "mqa", "gqa4"])
def test_varlen_fresh_matches_attend_causal(num_q_heads, num_kv_heads, dtype):
    q_lens = [5, 33, 1]
    total = sum(q_lens)
    query = torch.randn(total, num_q_heads, 64).to(dtype).to(DEVICE)
    key = torch.randn(total, num_kv_heads, 64).to(dtype).to(DEVICE)
    value = torch.randn(total, num_kv_heads, 64).to(dtype).to(DEVICE)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    starts = qsl.tolist()
    expected = torch.cat(
        [attend_causal(query[a:b], key[a:b], value[a:b], 0.125) for a, b in zip(starts[:-1], starts[1:])]
    )
    actual = varlen_causal_attention_triton(query, key, value, qsl, 0.125, block_m=16, block_n=16)
    assert_close(actual, expected, dtype)


def test_prefill_non_contiguous_query():
    # query as a strided view of a fused qkv projection output
    q_lens, ctx_lens = [6, 11], [4, 0]
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    key_cache, value_cache, tables = make_paged_kv(seq_lens, 2, 32, 16, torch.float32)
    qkv = torch.randn(sum(q_lens), 4 + 2 + 2, 32, device=DEVICE)
    query = qkv[:, :4]
    qsl = torch.tensor([0, 6, 17], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    expected = paged_prefill_attention_torch(query, key_cache, value_cache, tables, qsl, lens, 0.2)
    actual = paged_prefill_attention_triton(query, key_cache, value_cache, tables, qsl, lens, 0.2)
    assert_close(actual, expected, torch.float32)
