"""Quantized KV pools filled like decoding, and the torch reference attention over them: shared by
the tests of the native quantized-KV kernels (tests/kernels/test_kv_quant_native.py, test_kv_codes_native.py)."""

from __future__ import annotations

import torch

from llmctl.engine.kv_cache import KVFormat, QuantizedKVCache
from llmctl_kernels import kv_quant as kq


def filled_pool(
    kind: str,
    lens: list[int],
    *,
    heads: int = 2,
    head_dim: int = 32,
    block: int = 8,
    dtype: torch.dtype = torch.float32,
    group: int = 16,
    residual_tokens: int = 0,
    seed: int = 0,
):
    """A one-layer pool holding random K/V of each sequence, stored one token per step like decoding.
    Returns (layer view, int32 block tables, seq lens)."""
    gen = torch.Generator().manual_seed(seed)
    fmt = KVFormat(kind, 1, heads, head_dim, block, dtype, group_size=group, residual_tokens=residual_tokens)
    per_seq = [-(-n // block) for n in lens]
    cache = QuantizedKVCache(
        fmt, sum(per_seq) + 1, len(lens) * max(1, fmt.residual_blocks_per_seq()), torch.device("cpu")
    )
    cache.zero_blocks(0, cache.num_blocks)
    tables, next_block = [], 1
    for n in per_seq:
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    layer = cache.layer(0)
    for pos in range(max(lens)):
        seqs = [i for i, n in enumerate(lens) if pos < n]
        slots = [tables[i][pos // block] * block + pos % block for i in seqs]
        cache.begin_step(slots, [pos] * len(seqs), [tables[i] for i in seqs])
        k = torch.randn(len(seqs), heads, head_dim, generator=gen)
        k[..., 3] += 5  # an outlier channel
        layer.store(k.to(dtype), torch.randn(len(seqs), heads, head_dim, generator=gen).to(dtype), torch.tensor(slots))
    cache.begin_step([])
    width = max(per_seq)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return layer, table, torch.tensor(lens, dtype=torch.int32)


def reference(layer, query, table, lens, scale):
    keys, values = layer.gather(table, int(lens.max()), query.dtype)
    return kq.decode_attention_dense(query, keys, values, lens, scale)
