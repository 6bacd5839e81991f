"""Shared helpers of the kernel tests: the device under test, tolerances, random paged caches."""

from __future__ import annotations

import os

import torch

DEVICE = torch.device(os.environ.get("LLMCTL_TEST_DEVICE", "cpu"))

# (atol, rtol) of attention outputs against the torch reference. bf16/fp16 outputs differ from
# the reference by output rounding (and, on a GPU, by P rounded to bf16/fp16 before P @ V).
ATTN_TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, tol=None) -> None:
    atol, rtol = tol or ATTN_TOL[dtype]
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    spare_blocks: int = 3,
    table_width: int | None = None,
    generator: torch.Generator | None = None,
):
    """A random K/V pool and block tables whose blocks are scattered (shuffled) across the pool.

    Returns ``key_cache, value_cache, block_tables`` (int32). Tables are padded with valid block
    ids, and the pool has spare blocks holding garbage that must never be read.
    """
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=generator)
    width = max(max(blocks_per_seq, default=1), 1) if table_width is None else table_width
    tables = torch.full((len(seq_lens), width), int(perm[-1]), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    return key_cache.to(DEVICE), value_cache.to(DEVICE), tables.to(DEVICE)


def to_device(*tensors: torch.Tensor):
    return tuple(t.to(DEVICE) for t in tensors)
