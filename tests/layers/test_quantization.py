"""Quantized weights end to end: quantizers, packed linear layers, the packed embedding / LM head,
on-the-fly ``--quantization`` on a tiny model, and the weight-bytes accounting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_factory import random_prompts

from llmctl.config import EngineConfig
from llmctl.engine.llm_engine import LLMEngine
from llmctl.errors import ConfigError
from llmctl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from llmctl.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from llmctl.layers.quantization import (
    PackedInt8,
    dequantize,
    install_packed_embedding,
    install_packed_weight,
    linear_method_for,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    weight_bytes,
)
from llmctl.layers.quantization.matmul import bound_cpu_kernel
from llmctl.sampling_params import SamplingParams
from llmctl_kernels.packed_formats import unpack_int4

VOCAB = 320


def _w(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


# ---- quantizers --------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [None, 32])
def test_int8_rounds_to_half_a_step(group):
    w = _w(16, 128)
    packed = quantize_int8(w, group)
    assert packed.qweight.dtype == torch.int8 and packed.mins is None
    assert packed.scales.shape == (16, 1 if group is None else 4)
    assert packed.qweight.abs().max() == 127  # the largest |w| of each group maps to +-127
    step = packed.scales.repeat_interleave(packed.group_size, 1)
    assert ((dequantize(packed) - w).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_is_asymmetric_with_a_float_min(group):
    w = _w(8, 256) + 0.5  # not centred on zero
    packed = quantize_int4(w, group)
    assert packed.qweight.shape == (8, 128) and packed.scales.shape == packed.mins.shape == (8, 256 // group)
    step, mins = packed.scales.repeat_interleave(group, 1), packed.mins.repeat_interleave(group, 1)
    q = unpack_int4(packed.qweight)  # both nibbles used: low = even k, high = odd k
    assert torch.equal(q.float(), torch.round((w - mins) / step).clamp(0, 15))  # each weight's nearest level
    inside = (w >= mins) & (w <= mins + 15 * step)
    assert ((dequantize(packed) - w).abs()[inside] <= step[inside] / 2 + 1e-5).all()
    assert inside.float().mean() > 0.95  # the searched range may clip a few extremes, not more


def test_int4_rejects_other_groups():
    with pytest.raises(ValueError, match="32, 64 or 128"):
        quantize_int4(_w(4, 96), 48)


def test_fp8_keeps_three_mantissa_bits():
    w = _w(8, 64)
    packed = quantize_fp8(w)
    assert packed.qweight.dtype == torch.uint8 and packed.scales.shape == (8,)
    scaled = w / packed.scales[:, None]
    assert ((scaled.abs().amax(1) > 224) & (scaled.abs().amax(1) <= 448)).all()  # a searched scale, no saturation
    err = (dequantize(packed) - w).abs()
    assert (err <= w.abs() / 16 + packed.scales[:, None] * 2.0**-10).all()  # half an ulp, or subnormal step


# ---- packed linear layers ----------------------------------------------------------------------
def _layers():
    return {
        "column": ColumnParallelLinear(64, 96, bias=True, dtype=torch.float32),
        "row": RowParallelLinear(128, 64, bias=True, dtype=torch.float32),
        "qkv": QKVParallelLinear(64, 16, 4, 2, dtype=torch.float32),
        "merged": MergedColumnParallelLinear(64, [96, 96], dtype=torch.float32),
    }


@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("name", ["column", "row", "qkv", "merged"])
def test_install_packed_weight(kind, name):
    layer = _layers()[name]
    n, k = layer.out_features, layer.in_features
    if layer.bias is not None:
        layer.bias.data.normal_()
    packed = {"int4": lambda w: quantize_int4(w, 32), "int8": quantize_int8, "fp8": quantize_fp8}[kind](_w(n, k))
    install_packed_weight(layer, packed)
    assert not hasattr(layer, "weight") and "weight" not in dict(layer.named_parameters())
    assert layer.qweight.data_ptr() == packed.qweight.data_ptr()  # installed, not copied
    x = torch.randn(5, k)
    expected = F.linear(x, dequantize(packed), layer.bias)
    got = layer(x)
    # int4/int8 multiply int16-rounded activations on the native path: within ~1% of the output scale
    torch.testing.assert_close(got, expected, atol=0.02 * expected.abs().max().item(), rtol=0)


def test_install_checks_shape_and_tensor_parallel():
    layer = ColumnParallelLinear(64, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="layer needs"):
        install_packed_weight(layer, quantize_int8(_w(16, 64)))
    with pytest.raises(ValueError, match="scales must be float32"):
        bad = quantize_int8(_w(32, 64))
        install_packed_weight(layer, PackedInt8(bad.qweight, bad.scales.double(), None, 64))


def test_packed_embedding_and_tied_lm_head_share_one_table():
    vocab, hidden = 100, 64
    embed = VocabParallelEmbedding(vocab, hidden, dtype=torch.float32)
    head = ParallelLMHead(vocab, hidden, dtype=torch.float32)
    head.weight = embed.weight  # tied, as in the model
    packed = quantize_int8(_w(vocab, hidden), 32)  # a Q8_0-like table
    for module in (embed, head):
        install_packed_embedding(module, packed)
    head.process_weights_after_loading()
    ids = torch.tensor([[3, 99, 0], [3, 4, 5]])
    table = dequantize(packed)
    assert torch.equal(embed(ids), table[ids])
    hidden_states = torch.randn(4, hidden)
    expected = hidden_states @ table.t()
    torch.testing.assert_close(head(hidden_states), expected, atol=0.02 * expected.abs().max().item(), rtol=0)
    assert head.qweight.data_ptr() == embed.qweight.data_ptr()
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    kernel_copy = getattr(bound_cpu_kernel(head), "tiles", torch.empty(0)).numel()  # the LM head's interleaved tiles
    assert weight_bytes(model) == vocab * hidden + vocab * (hidden // 32) * 4 + kernel_copy


# ---- weight bytes ------------------------------------------------------------------------------
def test_weight_bytes_counts_packed_layers_and_tied_weights_once():
    plain = ColumnParallelLinear(256, 128, bias=True, dtype=torch.float32)
    assert weight_bytes(plain) == (128 * 256 + 128) * 4
    install_packed_weight(plain, quantize_int4(_w(128, 256), 64))
    packed_bytes = 128 * 256 // 2 + 2 * 128 * (256 // 64) * 4
    assert weight_bytes(plain) == packed_bytes + 128 * 4  # the float bias stays
    assert packed_bytes / (128 * 256) == pytest.approx(0.625)  # int4 g64: ~0.6 bytes per weight


# ---- on-the-fly quantization of a checkpoint ---------------------------------------------------
def test_config_validates_quantization():
    with pytest.raises(ConfigError, match="unknown quantization"):
        EngineConfig(quantization="int3")
    with pytest.raises(ConfigError, match="group size"):
        EngineConfig(quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="unknown quantization"):
        linear_method_for("nf4")


def _engine(model_dir, quantization: str, **kw) -> LLMEngine:
    return LLMEngine(
        model=str(model_dir),
        skip_tokenizer=True,
        dtype="float32",
        kv_cache_memory=8 << 20,
        quantization=quantization,
        **kw,
    )


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_on_the_fly_batched_decode_matches_alone(llama_dir, kind):
    prompts = random_prompts(6, VOCAB, 3, 30, seed=11)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = _engine(llama_dir, kind)
    batched = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    alone = [engine.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    # Each quantized row's result is batch-independent (tests/kernels/test_quant_native.py), but the
    # float path around it is exact only to rounding (padded attention), and rounding activations
    # to int8 can turn a last-bit difference into a step, and this random model's logits are close
    # (with --quant-exact-activations all six agree): allow late divergences.
    assert [a[:4] for a in alone] == [b[:4] for b in batched]
    assert sum(a == b for a, b in zip(alone, batched)) >= len(prompts) // 2
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_prompt_in_several_chunks_with_an_int8_lm_head(llama_dir, kind):
    """A middle prefill chunk samples nothing, so the LM head gets no rows: it returns none (before,
    the int8 logits path failed on the empty view, and the engine loop with it), and the request
    gives the tokens it gives in one chunk."""
    from llmctl.layers.ops import TorchOps
    from llmctl.models.loader import load_model

    head = load_model(llama_dir, dtype="float32", device=torch.device("cpu"), ops=TorchOps(), quantization=kind).lm_head
    assert head(torch.zeros(0, head.hidden_size)).shape == (0, head.vocab_size)
    prompt = random_prompts(1, VOCAB, 40, 41, seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    chunked = _engine(llama_dir, kind, max_num_batched_tokens=16).generate([prompt], params)[0]
    whole = _engine(llama_dir, kind).generate([prompt], params)[0]
    assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids


STORIES_PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park",
    "One day, a big bird",
    "Sara had a red ball",
    "The sun was hot and",
    "Tim saw a cat",
    "Mom said",
]


@pytest.fixture(scope="module")
def stories_fp32_tokens(stories_dir):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = LLMEngine(model=str(stories_dir), dtype="float32", kv_cache_memory=8 << 20)
    return [o.outputs[0].token_ids for o in engine.generate(STORIES_PROMPTS, params)]


# stories260k has 260K parameters: a weight's rounding moves its logits far more than in a real
# model, so int4 keeps fewer first tokens (measured 8/8 int8, 7/8 fp8, 6/8 int4 g64).
@pytest.mark.parametrize(("kind", "min_first"), [("int8", 7), ("fp8", 6), ("int4", 5)])
def test_on_the_fly_greedy_tokens_track_fp32(stories_dir, stories_fp32_tokens, kind, min_first):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = LLMEngine(model=str(stories_dir), dtype="float32", kv_cache_memory=8 << 20, quantization=kind)
    got = [o.outputs[0].token_ids for o in engine.generate(STORIES_PROMPTS, params)]
    assert sum(a[0] == b[0] for a, b in zip(got, stories_fp32_tokens)) >= min_first
    assert any(a == b for a, b in zip(got, stories_fp32_tokens))  # some whole 16-token answers agree


def test_on_the_fly_layers_are_packed_and_smaller(llama_dir):
    from llmctl.layers.ops import TorchOps
    from llmctl.models.loader import load_model

    fp32 = load_model(llama_dir, dtype="float32", device=torch.device("cpu"), ops=TorchOps())
    int4 = load_model(
        llama_dir,
        dtype="float32",
        device=torch.device("cpu"),
        ops=TorchOps(),
        quantization="int4",
        quantization_group_size=32,
    )
    layer = int4.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert linear.packed_format == "int4" and "weight" not in linear._parameters
    assert int4.model.embed_tokens.packed_format is None  # the embedding stays in float
    head = int4.lm_head  # the LM head's logits come from a per-channel int8 copy instead of a float one
    assert (
        head.packed_format is None and head.packed_weight is None and head.logits_packed.group_size == head.hidden_size
    )
    rows, hidden = head.logits_packed.shape
    float_copy = 4 * rows * hidden if fp32.lm_head.packed_weight is not None else 0  # fp32's prepacked logits copy
    linear_params = sum(p.numel() for n, p in fp32.named_parameters() if "proj" in n)
    saved = weight_bytes(fp32) - weight_bytes(int4)
    expected = linear_params * (4 - 0.75) + float_copy - (rows * hidden + 4 * rows)  # int8 head: 1 B/param + scales
    assert saved == pytest.approx(expected, rel=0.02)  # linear layers fp32 -> ~0.75 B/param at g32


@pytest.mark.parametrize(("kind", "int8_logits"), [("int8", True), ("int4", True), ("fp8", False)])
def test_lm_head_logits_from_an_int8_copy(llama_dir, kind, int8_logits):
    """int8 and int4 compute the logits from a per-channel int8 copy of the (tied or not) table, the
    arithmetic of the int8 linear layers bit for bit, a row's logits independent of the batch; the
    embedding keeps looking up the float rows. fp8 keeps float logits."""
    from llmctl.layers.ops import TorchOps
    from llmctl.models.loader import load_model
    from llmctl_kernels.quant_linear import per_channel_int8_reference

    model = load_model(llama_dir, dtype="float32", device=torch.device("cpu"), ops=TorchOps(), quantization=kind)
    head = model.lm_head
    assert (head.logits_packed is not None) == int8_logits
    hidden = torch.randn(9, head.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = head(hidden)
    if not int8_logits:
        torch.testing.assert_close(logits, hidden @ head.weight.t())
        return
    assert torch.equal(logits, per_channel_int8_reference(hidden, quantize_int8(head.weight.data)))
    assert torch.equal(head(hidden[4:5]), logits[4:5])
    torch.testing.assert_close(logits, hidden @ head.weight.t(), atol=0.02 * logits.abs().max().item(), rtol=0)
    ids = torch.tensor([1, 2, 3])
    assert torch.equal(model.model.embed_tokens(ids), F.embedding(ids, model.model.embed_tokens.weight))
