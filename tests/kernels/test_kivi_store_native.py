"""The native KIVI store (kernels/cpu/kv_quant_attention.cpp: kivi_store) against the torch reference
(kv_cache.QuantizedLayerKV.stage + kv_quant.quantize_kivi_*): the same traffic through both must
leave every code, scale, zero, residual row and staging row bit for bit equal. The native decode
loop calls the same function, so its KIVI steps store what the module path stores."""

from __future__ import annotations

import pytest
import torch

from llmctl.engine.kv_cache import KVFormat, QuantizedKVCache
from llmctl_kernels.kv_quant_native import load_kv_quant_native

pytestmark = pytest.mark.skipif(
    load_kv_quant_native() is None, reason="needs the native KV-quant module (C++ compiler)"
)


def _cache(
    kind: str, *, heads: int, head_dim: int, block: int, group: int, residual_tokens: int, native: bool, seats: int
) -> QuantizedKVCache:
    fmt = KVFormat(kind, 1, heads, head_dim, block, torch.float32, group_size=group, residual_tokens=residual_tokens)
    cache = QuantizedKVCache(fmt, 64, seats * max(1, fmt.residual_blocks_per_seq()), torch.device("cpu"))
    cache.zero_blocks(0, cache.num_blocks)
    assert cache.native_kivi_store
    cache.native_kivi_store = native
    return cache


def _awkward(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random rows with the cases rounding and saturation hinge on: an outlier channel, a constant
    channel (zero scale), values on a half-step grid (ties in the code rounding) and values beyond
    float16's range (saturated scale and zero)."""
    x = torch.randn(shape, generator=gen)
    x[..., 3] += 5
    x[..., 5] = 0.75
    x[..., 6] = torch.randint(-8, 8, x[..., 6].shape, generator=gen).float() / 2
    big = torch.rand(shape[:-1], generator=gen) < 0.05
    x[..., 7] = torch.where(big, torch.full_like(x[..., 7], 1e6), x[..., 7])
    return x


def _run_traffic(
    kind: str,
    seed: int,
    *,
    heads: int = 2,
    head_dim: int = 32,
    block: int = 8,
    group: int = 16,
    residual_tokens: int = 0,
    strided: bool = False,
) -> list[dict]:
    """Sequences prefilled in chunks of random length, then decoded together; the same traffic
    through a native-store cache and a reference-store cache. Returns both caches' state."""
    gen = torch.Generator().manual_seed(seed)
    lens = [int(torch.randint(5, 60, (1,), generator=gen)) for _ in range(4)]
    caches = [
        _cache(
            kind,
            heads=heads,
            head_dim=head_dim,
            block=block,
            group=group,
            residual_tokens=residual_tokens,
            native=native,
            seats=len(lens),
        )
        for native in (True, False)
    ]
    tables, next_block = [], 1
    for n in lens:
        count = -(-n // block)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    done = [0] * len(lens)
    staged = [[], []]
    while any(d < n for d, n in zip(done, lens)):
        slots, positions, token_tables = [], [], []
        for i, n in enumerate(lens):
            if done[i] >= n:
                continue
            chunk = 1 if done[i] >= n // 2 else int(torch.randint(1, 20, (1,), generator=gen))
            for pos in range(done[i], min(n, done[i] + chunk)):
                slots.append(tables[i][pos // block] * block + pos % block)
                positions.append(pos)
                token_tables.append(tables[i])
            done[i] = min(n, done[i] + chunk)
        width = heads * head_dim
        rows = _awkward((len(slots), 3 * width if strided else 2 * width), gen)
        key = rows[:, :width].view(len(slots), heads, head_dim)  # a row stride of 2-3 widths, as in a fused qkv
        value = rows[:, width : 2 * width].view(len(slots), heads, head_dim)
        for c, cache in enumerate(caches):
            cache.begin_step(slots, positions, token_tables)
            cache.layer(0).store(key, value, torch.tensor(slots))
            staged[c].append({name: t.clone() for name, t in cache.plan.staging.items()})
    return [
        dict(
            cache.tensors,
            res_k=cache.residual["k"],
            res_v=cache.residual["v"],
            staged=staged[c],
            residual_of=list(cache.residual_of),
        )
        for c, cache in enumerate(caches)
    ]


def _assert_same(native: dict, reference: dict) -> None:
    assert native["residual_of"] == reference["residual_of"]
    for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero", "res_k", "res_v"):
        assert torch.equal(native[name].view(torch.uint8), reference[name].view(torch.uint8)), name
    assert len(native["staged"]) == len(reference["staged"])
    for a, b in zip(native["staged"], reference["staged"]):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("kind", ["kivi2", "kivi4"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_native_store_equals_reference(kind, seed):
    native, reference = _run_traffic(kind, seed)
    assert any(s["k"].numel() for s in native["staged"])  # blocks were quantized
    _assert_same(native, reference)


@pytest.mark.parametrize("kind", ["kivi2", "kivi4"])
def test_native_store_equals_reference_with_a_multi_block_window(kind):
    native, reference = _run_traffic(kind, 3, residual_tokens=24, strided=True)
    _assert_same(native, reference)


@pytest.mark.parametrize("head_dim,group,block", [(64, 32, 16), (128, 128, 8), (16, 4, 4)])
def test_native_store_equals_reference_other_shapes(head_dim, group, block):
    native, reference = _run_traffic("kivi2", 4, heads=3, head_dim=head_dim, block=block, group=group)
    _assert_same(native, reference)


def test_native_store_rejects_a_plan_out_of_range():
    cache = _cache("kivi2", heads=2, head_dim=32, block=8, group=16, residual_tokens=0, native=True, seats=2)
    cache.begin_step([8, 9])
    cache.plan.residual_rows[0] = 10_000
    key = torch.randn(2, 2, 32)
    with pytest.raises(RuntimeError, match="out of range"):
        cache.layer(0).store(key, key, torch.tensor([8, 9]))
