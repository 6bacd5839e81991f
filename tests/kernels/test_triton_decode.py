"""Paged decode attention: the Triton kernel against the torch reference."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, assert_close, make_paged_kv

from llmctl_kernels.decode_attention import (
    decode_num_splits,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
)


def _run(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, num_splits, block_n=None, **kv):
    key_cache, value_cache, tables = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, **kv)
    query = torch.randn(len(seq_lens), num_q_heads, head_dim).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    expected = paged_decode_attention_torch(query, key_cache, value_cache, tables, lens, scale)
    actual = paged_decode_attention_triton(
        query, key_cache, value_cache, tables, lens, scale, num_splits=num_splits, block_n=block_n
    )
    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("num_splits", [1, 4], ids=["nosplit", "split4"])
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads",
    [(2, 2), (4, 2), (4, 1), (8, 2), (8, 1), (6, 2)],
    ids=["mha", "gqa2", "mqa4", "gqa4", "mqa8", "gqa3"],
)
def test_decode_gqa_ratios(num_q_heads, num_kv_heads, num_splits):
    _run([1, 37, 150], num_q_heads, num_kv_heads, 64, 16, torch.float32, num_splits, block_n=32)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_decode_dtypes_and_shapes(dtype, head_dim, block_size):
    # alternate split-K on and off over the grid instead of doubling it
    num_splits = 3 if (head_dim + block_size) % 3 else 1
    _run([5, 70, 129], 4, 2, head_dim, block_size, dtype, num_splits)


@pytest.mark.parametrize("num_splits", [1, 2, 5, None], ids=["nosplit", "split2", "split5", "auto"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_context_lengths(block_size, num_splits):
    # 1 token, block edges +-1, several blocks; tiles of 16 tokens so partitions span many tiles
    seq_lens = [1, 2, 15, 16, 17, 31, 32, 33, 100, 257]
    _run(seq_lens, 2, 1, 32, block_size, torch.float32, num_splits, block_n=16)


def test_decode_more_splits_than_tokens():
    # most partitions of the short sequences are empty and must be ignored by the merge
    _run([1, 3, 64], 4, 2, 16, 16, torch.float32, num_splits=8, block_n=16)


def test_decode_wide_padded_table():
    # block tables much wider than needed, padded with a valid (garbage) block id
    _run([20, 9], 4, 1, 64, 16, torch.float16, num_splits=2, table_width=12, spare_blocks=6)


def test_decode_bf16_query_fp32_cache():
    key_cache, value_cache, tables = make_paged_kv([40, 7], 2, 64, 16, torch.float32)
    query = torch.randn(2, 4, 64).to(torch.bfloat16).to(DEVICE)
    lens = torch.tensor([40, 7], dtype=torch.int32, device=DEVICE)
    expected = paged_decode_attention_torch(query, key_cache, value_cache, tables, lens, 0.125)
    for splits in (1, 2):
        actual = paged_decode_attention_triton(query, key_cache, value_cache, tables, lens, 0.125, num_splits=splits)
        assert_close(actual, expected, torch.bfloat16)


def test_decode_max_seq_len_hint_and_empty_batch():
    key_cache, value_cache, tables = make_paged_kv([50, 3], 1, 16, 16, torch.float32)
    query = torch.randn(2, 2, 16, device=DEVICE)
    lens = torch.tensor([50, 3], dtype=torch.int32, device=DEVICE)
    expected = paged_decode_attention_torch(query, key_cache, value_cache, tables, lens, 0.25)
    actual = paged_decode_attention_triton(query, key_cache, value_cache, tables, lens, 0.25, max_seq_len=50)
    assert_close(actual, expected, torch.float32)
    empty = paged_decode_attention_triton(query[:0], key_cache, value_cache, tables[:0], lens[:0], 0.25)
    assert empty.shape == (0, 2, 16)


@pytest.mark.no_device
def test_decode_split_heuristic():
    sms = 132
    assert decode_num_splits(64, 8, 2048, sms) == 1  # 512 programs already fill the GPU
    assert decode_num_splits(1, 8, 32768, sms) == 33  # long context, tiny batch: split to ~2 waves
    assert decode_num_splits(1, 8, 100, sms) == 1  # too short to be worth a merge
    assert decode_num_splits(16, 8, 2048, sms) == 3
    assert decode_num_splits(1, 1, 10**6, sms) == 64  # capped
    assert decode_num_splits(4, 2, 4096, 1) == 1  # CPU interpreter: never split by default
