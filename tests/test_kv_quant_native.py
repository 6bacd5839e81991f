"""The native CPU decode kernel over a quantized KV pool (kernels/cpu/kv_quant_attention.cpp)
against the torch reference (gather + dequantize + attend) on the same pool: per KV dtype, per ISA
variant, fp32 and bf16 queries, GQA, KIVI residual blocks; batched == alone."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import kv_quant as kq
from kernels.cpu_features import supported_isa_levels
from kernels.kv_quant_native import load_kv_quant_native, quantized_decode_attention_native
from llmctl.engine.kv_cache import KVFormat, QuantizedKVCache

pytestmark = pytest.mark.skipif(load_kv_quant_native() is None, reason="no C++ compiler: native kernels not built")
QUANTIZED = [d for d in kq.KV_CACHE_DTYPES if d != "auto"]
LENS = [1, 5, 8, 19, 40, 77]  # inside one block, exactly one block, several, open last blocks


def filled_pool(kind: str, lens: list[int], *, heads: int = 2, head_dim: int = 32, block: int = 8,
                dtype: torch.dtype = torch.float32, group: int = 16, residual_tokens: int = 0, seed: int = 0):
    """A one-layer pool holding random K/V of each sequence, stored one token per step like decoding.
    Returns (layer view, int32 block tables, seq lens)."""
    gen = torch.Generator().manual_seed(seed)
    fmt = KVFormat(kind, 1, heads, head_dim, block, dtype, group_size=group, residual_tokens=residual_tokens)
    per_seq = [-(-n // block) for n in lens]
    cache = QuantizedKVCache(fmt, sum(per_seq) + 1, len(lens) * max(1, fmt.residual_blocks_per_seq()),
                             torch.device("cpu"))
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


def native(layer, query, table, lens, scale):
    return quantized_decode_attention_native(
        query, layer.fmt.kind, layer.t, table, lens, scale, value_group=layer.fmt.value_group,
        residual=layer.residual, residual_table=getattr(layer.cache.plan, "residual_table", None))


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
    torch.testing.assert_close(native(layer, query, table, lens, scale), reference(layer, query, table, lens, scale),
                               atol=2e-6, rtol=1e-5)


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


@pytest.mark.parametrize("kind", ["int8", "kivi2"])
def test_native_batched_equals_alone(kind, isa):
    layer, table, lens = filled_pool(kind, LENS)
    query = torch.randn(len(LENS), 4, 32)
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
    torch.testing.assert_close(native(layer, query, table, lens, 0.2), reference(layer, query, table, lens, 0.2),
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["fp8_e5m2", "kivi2"])
def test_engine_decodes_with_the_native_kernel_like_the_reference(llama_dir, kind):
    """The engine on CPU uses the kernel; switching it off (the reference path, as where the build
    is missing) gives the same greedy tokens."""
    from model_factory import random_prompts

    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.sampling_params import SamplingParams

    engine = LLMEngine(model=str(llama_dir), skip_tokenizer=True, dtype="float32", kv_cache_dtype=kind,
                       kv_cache_memory=4 << 20, kv_residual_length=32)
    assert engine.runner.quantized_kv.native_decode
    prompts = random_prompts(4, 320, 10, 40, seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    native_out = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    engine.runner.quantized_kv.native_decode = False
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, params)] == native_out
