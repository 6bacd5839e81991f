"""The native CPU decode kernel over a quantized KV pool (kernels/cpu/kv_quant_attention.cpp)
against the torch reference (gather + dequantize + attend) on the same pool: per KV dtype, per ISA
variant, fp32 and bf16 queries, GQA, KIVI residual blocks, KIVI's tiled path at head_dim 64/128;
batched == alone."""

from __future__ import annotations

import math

import pytest
import torch
from kv_pool_factory import filled_pool, reference

from llmctl_kernels import kv_quant as kq
from llmctl_kernels.cpu_features import supported_isa_levels
from llmctl_kernels.kv_quant_native import load_kv_quant_native, quantized_decode_attention_native

pytestmark = pytest.mark.skipif(load_kv_quant_native() is None, reason="no C++ compiler: native kernels not built")
QUANTIZED = [d for d in kq.KV_CACHE_DTYPES if d != "auto"]
LENS = [1, 5, 8, 19, 40, 77]  # inside one block, exactly one block, several, open last blocks


def native(layer, query, table, lens, scale):
    return quantized_decode_attention_native(
        query,
        layer.fmt.kind,
        layer.t,
        table,
        lens,
        scale,
        value_group=layer.fmt.value_group,
        residual=layer.residual,
        residual_table=getattr(layer.cache.plan, "residual_table", None),
    )


@pytest.fixture(params=["generic", "avx2"])
def isa(request):
    module = load_kv_quant_native()
    if request.param == "avx2" and "avx2" not in supported_isa_levels():
        pytest.skip("this CPU has no AVX2")
    previous = module.isa()
    module.set_isa(request.param)
    yield request.param
    module.set_isa(previous)


@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("head_dim,group", [(32, 16), (24, 8), (12, 4)])
def test_native_equals_reference_fp32(kind, head_dim, group, isa):
    layer, table, lens = filled_pool(kind, LENS, head_dim=head_dim, group=group)
    query = torch.randn(len(LENS), 6, head_dim)  # GQA: 3 query heads per KV head
    scale = 1 / math.sqrt(head_dim)
    torch.testing.assert_close(
        native(layer, query, table, lens, scale), reference(layer, query, table, lens, scale), atol=2e-6, rtol=1e-5
    )


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8", "kivi2", "kivi4"])
def test_native_equals_reference_bf16(kind, isa):
    """bf16: the reference rounds dequantized K/V to bf16 before attending, the kernel keeps them in
    fp32, so agreement is to bf16 precision."""
    layer, table, lens = filled_pool(kind, LENS, dtype=torch.bfloat16)
    query = torch.randn(len(LENS), 4, 32).to(torch.bfloat16)
    got = native(layer, query, table, lens, 1 / math.sqrt(32))
    want = reference(layer, query, table, lens, 1 / math.sqrt(32))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["kivi2", "kivi4"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kivi_tiles_equal_reference(kind, head_dim, block, dtype, isa):
    """head_dim 64/128 on AVX2: the score tiles and V chunks over dequantized rows, quantized and
    residual (a two-block window) blocks mixed in one sequence."""
    layer, table, lens = filled_pool(
        kind, LENS, head_dim=head_dim, block=block, dtype=dtype, group=32, residual_tokens=2 * block
    )
    query = torch.randn(len(LENS), 6, head_dim).to(dtype)
    got = native(layer, query, table, lens, 1 / math.sqrt(head_dim))
    want = reference(layer, query, table, lens, 1 / math.sqrt(head_dim))
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol * 5)


@pytest.mark.parametrize("kind", ["int8", "kivi2"])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_native_batched_equals_alone(kind, head_dim, isa):
    layer, table, lens = filled_pool(kind, LENS, head_dim=head_dim, residual_tokens=16)
    query = torch.randn(len(LENS), 4, head_dim)
    batched = native(layer, query, table, lens, 0.2)
    for i in range(len(LENS)):
        alone = native(layer, query[i : i + 1], table[i : i + 1, : -(-int(lens[i]) // 8)], lens[i : i + 1], 0.2)
        assert torch.equal(alone[0], batched[i])


def test_kivi_residual_blocks_are_read_in_full_precision():
    """A block with a residual slot is read from the residual, not from its (stale) codes."""
    layer, table, lens = filled_pool("kivi2", [12])  # block 1 open (4 tokens) in the residual
    query = torch.randn(1, 4, 32)
    before = native(layer, query, table, lens, 0.2)
    layer.t["k"][table[0, 1]] = 0xFF  # garbage codes under the open block: not read
    torch.testing.assert_close(native(layer, query, table, lens, 0.2), before, atol=0, rtol=0)
    layer.residual["k"][layer.cache.residual_of[int(table[0, 1])]] += 1.0  # its residual is
    assert not torch.equal(native(layer, query, table, lens, 0.2), before)


@pytest.mark.parametrize("kind", ["kivi2", "kivi4"])
def test_native_equals_reference_with_a_multi_block_window(kind, isa):
    """R = 3 blocks: a sequence reads up to three residual blocks in full precision, the rest quantized."""
    layer, table, lens = filled_pool(kind, LENS, residual_tokens=24)
    assert sum(slot >= 0 for slot in layer.cache.residual_of) > len(LENS)  # several open blocks per sequence
    query = torch.randn(len(LENS), 4, 32)
    torch.testing.assert_close(
        native(layer, query, table, lens, 0.2), reference(layer, query, table, lens, 0.2), atol=2e-6, rtol=1e-5
    )


@pytest.mark.parametrize("kind", ["fp8_e5m2", "kivi2"])
def test_engine_decodes_with_the_native_kernel_like_the_reference(llama_dir, kind):
    """The engine on CPU uses the kernel; switching it off (the reference path, as where the build
    is missing) gives the same greedy tokens."""
    from model_factory import random_prompts

    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.sampling_params import SamplingParams

    engine = LLMEngine(
        model=str(llama_dir),
        skip_tokenizer=True,
        dtype="float32",
        kv_cache_dtype=kind,
        kv_cache_memory=4 << 20,
        kv_residual_length=32,
    )
    assert engine.runner.quantized_kv.native_decode
    prompts = random_prompts(4, 320, 10, 40, seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    native_out = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    engine.runner.quantized_kv.native_decode = False
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, params)] == native_out
