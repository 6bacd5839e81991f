"""The native CPU kernels against their torch references, in every ISA variant this CPU runs
(generic x86-64 and AVX2 on an AVX2 machine; AVX-512 and AVX512-BF16 as well on a Xeon)."""

from __future__ import annotations

import shutil

import pytest
import torch

from llmctl_kernels.cpu_features import isa_level, supported_isa_levels
from llmctl_kernels.cpu_native import load_native, native_unavailable_reason, paged_decode_attention_native
from llmctl_kernels.decode_attention import paged_decode_attention_torch

if native_unavailable_reason() is not None and not shutil.which("g++"):
    pytest.skip(f"native CPU kernels: {native_unavailable_reason()}", allow_module_level=True)


def test_builds_where_a_compiler_exists():
    assert load_native() is not None, native_unavailable_reason()
    assert set(supported_isa_levels()) <= set(load_native().compiled_isas())


@pytest.fixture(params=supported_isa_levels())
def isa(request):
    """Runs the test once per kernel variant this CPU can execute, then restores the best one."""
    module = load_native()
    module.set_isa(request.param)
    yield request.param
    module.set_isa(isa_level())


TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2), (8, 1), (9, 3)])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_seqs", [1, 9])
def test_matches_reference(isa, dtype, num_q_heads, num_kv_heads, head_dim, block_size, num_seqs):
    gen = torch.Generator().manual_seed(num_seqs * 1000 + head_dim + block_size + num_q_heads)
    num_blocks = 40
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(
        [1, 5, block_size, block_size + 1, 3 * block_size - 2, 70, 2, 33, 4 * block_size][:num_seqs], dtype=torch.int32
    ).clamp(max=4 * block_size)
    max_blocks = 4
    # scattered, shuffled block tables; padding entries point at a real block
    block_tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks].view(num_seqs, max_blocks)
    block_tables = block_tables.to(torch.int32)
    query = torch.randn(num_seqs, num_q_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    expected = paged_decode_attention_torch(query, key_cache, value_cache, block_tables, lens, scale)
    got = paged_decode_attention_native(query, key_cache, value_cache, block_tables, lens, scale)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_split_heads_when_few_sequences(isa, dtype):
    """Two sequences: one thread takes all KV heads of a sequence per task, two threads split the
    heads into separate tasks. Both layouts must give the same result."""
    torch.manual_seed(0)
    kc = torch.randn(8, 16, 4, 64).to(dtype)
    vc = torch.randn(8, 16, 4, 64).to(dtype)
    q = torch.randn(2, 16, 64).to(dtype)
    bt = torch.tensor([[3, 1, 7, 0], [2, 5, 6, 4]], dtype=torch.int32)
    lens = torch.tensor([50, 61], dtype=torch.int32)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        a = paged_decode_attention_native(q, kc, vc, bt, lens, 0.125)
        torch.set_num_threads(1)
        b = paged_decode_attention_native(q, kc, vc, bt, lens, 0.125)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_equals_unbatched(isa, dtype):
    """A sequence's attention is bitwise the same alone and in a batch of 12 (the batch size changes
    how the kernels split tasks, and once chose another bf16 kernel), on one thread or two."""
    gen = torch.Generator().manual_seed(5)
    kc = torch.randn(64, 16, 3, 64, generator=gen).to(dtype)
    vc = torch.randn(64, 16, 3, 64, generator=gen).to(dtype)
    q = torch.randn(12, 9, 64, generator=gen).to(dtype)
    bt = torch.randperm(64, generator=gen)[:48].view(12, 4).to(torch.int32)
    lens = torch.tensor([1, 17, 64, 33, 5, 40, 63, 2, 16, 48, 31, 9], dtype=torch.int32)
    old = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            batched = paged_decode_attention_native(q, kc, vc, bt, lens, 0.125)
            three = paged_decode_attention_native(q[:3], kc, vc, bt[:3], lens[:3], 0.125)
            assert torch.equal(three, batched[:3]), threads
            for i in range(12):
                alone = paged_decode_attention_native(q[i : i + 1], kc, vc, bt[i : i + 1], lens[i : i + 1], 0.125)
                assert torch.equal(alone, batched[i : i + 1]), (threads, i)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_store_matches_reference_and_skips_padding(dtype):
    from llmctl_kernels.cpu_native import reshape_and_cache_native
    from llmctl_kernels.kv_store import reshape_and_cache_torch

    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(7, 3 * 2 * 16, generator=gen).to(dtype)  # strided K/V views, as the model makes them
    key, value = qkv[:, 32:64].view(7, 2, 16), qkv[:, 64:].view(7, 2, 16)
    slots = torch.tensor([5, 0, -1, 63, 17, -1, 40])
    caches = [torch.zeros(4, 16, 2, 16, dtype=dtype) for _ in range(4)]
    reshape_and_cache_torch(key, value, caches[0], caches[1], slots)
    reshape_and_cache_native(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[2].view(64, 2, 16)[63].equal(key[3])


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("rows", [1, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(isa, dtype, with_residual, rows):
    from llmctl_kernels.cpu_native import rms_norm_native
    from llmctl_kernels.rms_norm import rms_norm_torch

    gen = torch.Generator().manual_seed(rows)
    hidden = 576 if rows == 64 else 256  # 576: SmolLM2's width, not a multiple of the vector tail
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype) if with_residual else None
    weight = torch.randn(hidden, generator=gen).to(dtype)
    (out, res), (ref_out, ref_res) = (
        rms_norm_native(x, weight, 1e-5, residual),
        rms_norm_torch(x, weight, 1e-5, residual),
    )
    assert torch.equal(res, ref_res)  # the residual add rounds exactly like torch's add
    # the fp32 sum of squares is accumulated in another order: at most one bf16 ulp, rarely; in
    # fp32 a few ulps of the normalisation factor
    if dtype == torch.bfloat16:
        torch.testing.assert_close(out.float(), ref_out.float(), atol=0, rtol=2**-6)  # one bf16 ulp
        assert (out != ref_out).float().mean() < 0.01
    else:
        torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(isa, dtype):
    from llmctl_kernels.activation import silu_and_mul_torch
    from llmctl_kernels.cpu_native import silu_and_mul_native

    x = (torch.randn(37, 2 * 200, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    got, expected = silu_and_mul_native(x), silu_and_mul_torch(x)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), expected.float(), atol=0, rtol=2**-6)  # one bf16 ulp
        assert (got != expected).float().mean() < 0.01
    else:  # the polynomial exp is within a couple of ulps of torch's
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_reference_on_strided_views(isa, dtype, rotary_dim):
    from llmctl_kernels.cpu_native import rotary_embedding_native
    from llmctl_kernels.rotary import rotary_embedding_torch

    gen = torch.Generator().manual_seed(rotary_dim)
    tokens = 21
    qkv = torch.randn(tokens, (8 + 2 + 2) * 64, generator=gen).to(dtype)
    q, k = qkv[:, : 8 * 64].view(tokens, 8, 64), qkv[:, 8 * 64 : 10 * 64].view(tokens, 2, 64)
    positions = torch.randint(0, 500, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(512).float()[:, None] * inv_freq[None]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    got, expected = rotary_embedding_native(positions, q, k, cache), rotary_embedding_torch(positions, q, k, cache)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])  # same rounding, step by step


def test_float64_is_refused_with_a_clear_error():
    from llmctl_kernels.cpu_native import silu_and_mul_native

    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 expected"):
        silu_and_mul_native(torch.randn(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_reference(isa, dtype, num_q_heads, num_kv_heads, head_dim, block_size):
    """Fresh prompts and extends (a cached prefix before the chunk) of lengths around the 8-row
    query blocks and the 8- or 16-token score vectors, in scattered blocks, against torch's SDPA
    reference."""
    from llmctl_kernels.cpu_native import paged_prefill_attention_native, prefill_attention_native_supported
    from llmctl_kernels.prefill_attention import paged_prefill_attention_torch

    gen = torch.Generator().manual_seed(head_dim + block_size + num_q_heads)
    key_cache = torch.randn(60, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(60, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    # (query tokens, sequence length): fresh chunks (equal) and extends (a prefix already cached)
    chunks = [(1, 1), (7, 7), (8, 8), (9, 9), (70, 70), (1, 40), (5, 33), (17, 3 * block_size), (16, 16), (23, 47)]
    max_blocks = 6  # 60 blocks: 10 chunks x 6
    tables = torch.randperm(60, generator=gen)[: len(chunks) * max_blocks].view(len(chunks), max_blocks).to(torch.int32)
    starts = torch.tensor([0] + [q for q, _ in chunks], dtype=torch.int32).cumsum(0).to(torch.int32)
    lens = torch.tensor([n for _, n in chunks], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), num_q_heads, head_dim, generator=gen).to(dtype)
    args = (query, key_cache, value_cache, tables, starts, lens, head_dim**-0.5)
    if isa == "generic":  # the intrinsics kernel is not compiled for it: the engine keeps SDPA
        assert not prefill_attention_native_supported(query, key_cache)
        return
    assert prefill_attention_native_supported(query, key_cache)
    expected = paged_prefill_attention_torch(*args)
    got = paged_prefill_attention_native(*args)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # a chunk's result does not depend on the other chunks of the batch
    alone = paged_prefill_attention_native(
        query[int(starts[6]) : int(starts[7])],
        key_cache,
        value_cache,
        tables[6:7],
        torch.tensor([0, chunks[6][0]], dtype=torch.int32),
        lens[6:7],
        head_dim**-0.5,
    )
    assert torch.equal(alone, got[int(starts[6]) : int(starts[7])])


def test_prefill_refuses_chunks_that_overrun_the_queries():
    from llmctl_kernels.cpu_native import paged_prefill_attention_native, prefill_attention_native_supported

    query, cache = torch.randn(5, 4, 64), torch.randn(4, 16, 4, 64)
    if not prefill_attention_native_supported(query, cache):
        pytest.skip("no AVX2: the native prefill is not compiled for this CPU")
    starts, lens = torch.tensor([0, 9], dtype=torch.int32), torch.tensor([9], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="query_start_loc must end"):
        paged_prefill_attention_native(query, cache, cache, torch.zeros(1, 4, dtype=torch.int32), starts, lens, 0.125)


def test_prefill_declines_other_dtypes_and_head_sizes():
    from llmctl_kernels.cpu_native import prefill_attention_native_supported

    assert not prefill_attention_native_supported(
        torch.zeros(2, 4, 64, dtype=torch.float16), torch.zeros(1, 16, 4, 64, dtype=torch.float16)
    )
    assert not prefill_attention_native_supported(
        torch.zeros(2, 4, 64), torch.zeros(1, 16, 4, 64, dtype=torch.bfloat16)
    )
    assert not prefill_attention_native_supported(torch.zeros(2, 4, 8), torch.zeros(1, 16, 4, 8))
