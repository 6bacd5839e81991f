"""The 8-bit KV kernels of the float kernels module (kernels/cpu/attention_f32.h on code rows,
cpu_kernels.cpp: decode, prefill, quantize-on-store), which the engine and the native decode loop
use for --kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2 at head_dim 64 or 128: against the torch
reference (kernels/kv_quant.py) in every AVX2-or-better variant this CPU runs; the store bit for
bit, every fp8 code's value exactly, batched == alone."""

from __future__ import annotations

import math

import pytest
import torch
from kv_pool_factory import filled_pool, reference

from llmctl_kernels import kv_quant as kq
from llmctl_kernels.cpu_features import isa_level, supported_isa_levels
from llmctl_kernels.cpu_native import (
    decode_codes_native_supported,
    load_native,
    paged_decode_attention_codes_native,
    paged_prefill_attention_codes_native,
    store_kv_codes_native,
)
from llmctl_kernels.prefill_attention import attend_causal

VARIANTS = [level for level in supported_isa_levels() if level != "generic"]
pytestmark = pytest.mark.skipif(
    load_native() is None or not VARIANTS, reason="needs the native CPU kernels on an AVX2 (or better) CPU"
)
KINDS = list(kq.PER_TOKEN_DTYPES)
LENS = [1, 5, 8, 19, 40, 77]  # inside one block, exactly one block, several, open last blocks


@pytest.fixture(params=VARIANTS)
def isa(request):
    module = load_native()
    module.set_isa(request.param)
    yield request.param
    module.set_isa(isa_level())


def test_supported_head_dims(isa):
    assert decode_codes_native_supported(64) and decode_codes_native_supported(128)
    assert not decode_codes_native_supported(32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_reference(kind, head_dim, dtype, isa):
    """bf16: the reference rounds dequantized K/V to bf16 before attending, the kernel keeps fp32."""
    layer, table, lens = filled_pool(kind, LENS, head_dim=head_dim, dtype=dtype)
    query = torch.randn(len(LENS), 6, head_dim).to(dtype)  # GQA: 3 query heads per KV head
    scale = 1 / math.sqrt(head_dim)
    got = paged_decode_attention_codes_native(query, kind, layer.t, table, lens, scale)
    want = reference(layer, query, table, lens, scale)
    assert got.dtype == dtype
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol * 5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_equals_reference(kind, dtype, isa):
    """Chunks of several lengths (one empty) at the end of their sequences, each causal over the pool."""
    layer, table, lens = filled_pool(kind, LENS, head_dim=64, dtype=dtype)
    q_lens = [1, 3, 8, 0, 40, 20]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), 6, 64).to(dtype)
    got = paged_prefill_attention_codes_native(query, kind, layer.t, table, starts, lens, 0.125)
    for i, length in enumerate(LENS):
        begin, end = int(starts[i]), int(starts[i + 1])
        if end == begin:
            continue
        keys, values = layer.gather(table[i : i + 1], length, torch.float32)
        want = attend_causal(query[begin:end].float(), keys[0], values[0], 0.125)
        tol = 2e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[begin:end].float(), want, atol=tol, rtol=tol * 5)


def empty_pool(kind: str, rows: int, heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    codes = kq.code_dtype(kind)
    return {
        "k": torch.zeros(rows, heads, head_dim, dtype=codes),
        "v": torch.zeros(rows, heads, head_dim, dtype=codes),
        "k_scale": torch.zeros(rows, heads),
        "v_scale": torch.zeros(rows, heads),
    }


@pytest.mark.parametrize("kind", KINDS)
def test_store_is_bit_identical_to_the_reference(kind, isa):
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(40, 3, 96, generator=gen) * torch.rand(40, 3, 1, generator=gen) * 20
    x = wide[..., :64]  # a strided view, as K/V come out of the fused qkv projection
    x[0, 0] = 0  # an all-zero row: scale 0, codes 0
    x[1, 1, :5] = 1e-30  # values far below the row's scale
    x[2, 2] = torch.arange(64) - 31.5  # int8 ties: x / scale lands on .5
    x[3, 0, 0] = 1e30  # a huge outlier
    slots = torch.randperm(50, generator=gen)[:40]
    slots[5] = -1  # a padding token: not stored
    pool = empty_pool(kind, 50, 3, 64)
    store_kv_codes_native(x, x * -3, kind, pool, slots)
    stored = slots >= 0
    for name, value in (("k", x), ("v", x * -3)):
        codes, scale = kq.quantize_per_token(value, kind)
        assert torch.equal(pool[name][slots[stored]].view(torch.uint8), codes[stored].view(torch.uint8)), name
        assert torch.equal(pool[name + "_scale"][slots[stored]], scale[stored]), name
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[slots[stored]] = False
    assert not pool["k"][untouched].view(torch.uint8).any() and not pool["k_scale"][untouched].any()


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_every_finite_fp8_code_reads_as_its_value(kind, isa):
    """One token: the output is its V row exactly (softmax weight 1, scale 1), so each of the 256
    codes (NaN and inf codes left out) must widen to exactly the value torch gives it."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kq.FP8_DTYPES[kind]).float()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[~values.isfinite()] = 0
    pool = empty_pool(kind, 8, 2, 128)  # one block of 8 rows, 2 KV heads x 128 = 256 codes in row 0
    pool["v"].view(torch.uint8)[0] = codes.view(2, 128)
    pool["v_scale"][0] = 1.0
    pool["k_scale"][0] = 1.0
    query = torch.randn(1, 2, 128)
    out = paged_decode_attention_codes_native(
        query,
        kind,
        {n: t.view(1, 8, *t.shape[1:]) for n, t in pool.items()},
        torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        0.1,
    )
    want = codes.view(kq.FP8_DTYPES[kind]).float().view(2, 128)
    assert torch.equal(out[0], want)


@pytest.mark.parametrize("kind", KINDS)
def test_batched_equals_alone(kind, isa):
    layer, table, lens = filled_pool(kind, LENS, head_dim=64)
    query = torch.randn(len(LENS), 4, 64)
    batched = paged_decode_attention_codes_native(query, kind, layer.t, table, lens, 0.2)
    for i in range(len(LENS)):
        width = -(-int(lens[i]) // 8)
        alone = paged_decode_attention_codes_native(
            query[i : i + 1], kind, layer.t, table[i : i + 1, :width], lens[i : i + 1], 0.2
        )
        assert torch.equal(alone[0], batched[i])


def test_refuses_what_it_does_not_take(isa):
    layer, table, lens = filled_pool("int8", [5], head_dim=64)
    with pytest.raises(RuntimeError, match="int8, fp8_e4m3 or fp8_e5m2"):
        paged_decode_attention_codes_native(torch.randn(1, 2, 64), "kivi2", layer.t, table, lens, 0.1)
    with pytest.raises(RuntimeError, match="head_dim 64 or 128"):
        paged_decode_attention_codes_native(torch.randn(1, 2, 32), "int8", layer.t, table, lens, 0.1)
