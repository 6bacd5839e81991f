"""Attention sinks (gpt-oss) on every attention path, against a dense float64 reference written out
here: head h's softmax runs over its visible scores and one more logit, sinks[h], whose share of
the probability mass contributes no value (transformers' gpt-oss eager attention). Fresh prefill,
prefill continuing a cached context, decodes and mixed steps, with and without a sliding window
and a logit soft cap; the torch references, the native CPU kernels (fp32 and bf16 caches), the
Triton ops (which hand sink layers to the references) and the 8-bit quantized KV caches."""

from __future__ import annotations

import pytest
import torch
from test_sliding_window_attention import (
    BS,
    CASES,
    HKV,
    HQ,
    SCALE,
    D,
    _quantized_layer,
    float_cache_reader,
    make_step,
)

from llmctl.engine.kv_cache import KVFormat, QuantizedKVCache
from llmctl.errors import UnsupportedModelError
from llmctl.layers import ops as ops_module
from llmctl.layers.attention import Attention
from llmctl.layers.ops import TorchOps
from llmctl_kernels.decode_attention import masked_attention

WINDOWS = [None, 1, 4, 16]
SINKS = torch.tensor([0.5, -1.0, 2.0, 4.0])  # one per query head; 4.0 takes most of the mass


def dense_reference(query, keys, values, positions, scale, window, softcap, sinks):
    """query [Lq, Hq, D] at ``positions`` over keys/values [L, Hkv, D], in float64, with sinks."""
    q, k, v = (t.double() for t in (query, keys, values))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    kv_pos = torch.arange(k.shape[0])[None, :]
    q_pos = torch.as_tensor(positions)[:, None]
    visible = kv_pos <= q_pos
    if window is not None:
        visible &= kv_pos > q_pos - window
    weights = scores.masked_fill(~visible, float("-inf")).exp()  # [H, Lq, L]; small logits: no overflow
    denominator = weights.sum(-1, keepdim=True) + sinks.double().exp()[:, None, None]
    return torch.einsum("hqk,khd->qhd", weights / denominator, v)


def expected(query, read_kv, seq_lens, new_positions, tables, window, softcap, sinks):
    out, row = torch.empty(query.shape, dtype=torch.float64), 0
    for i, positions in enumerate(new_positions):
        keys, values = read_kv(tables[i], seq_lens[i])
        n = len(positions)
        out[row : row + n] = dense_reference(
            query[row : row + n], keys, values, positions, SCALE, window, softcap, sinks
        )
        row += n
    return out


def run_layer(ops, window, softcap, step, sinks=SINKS):
    query, key, value, key_cache, value_cache, meta, seq_lens, new_positions, tables = step
    layer = Attention(HQ, HKV, D, SCALE, ops=ops, sliding_window=window, logit_softcap=softcap, sinks=sinks)
    layer.key_cache, layer.value_cache = key_cache, value_cache
    got = layer(query, key, value, meta).view(-1, HQ, D)
    reader = float_cache_reader(key_cache, value_cache)
    return got, expected(query, reader, seq_lens, new_positions, tables, window, softcap, sinks)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("native", [False, True])
def test_torch_ops(case, window, softcap, native):
    """TorchOps with and without the native CPU kernels."""
    got, want = run_layer(TorchOps(native_cpu=native), window, softcap, make_step(*CASES[case]))
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


def _refuse(*args, **kwargs):
    raise AssertionError("the torch reference ran")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, None), (4, None), (16, 3.0)])
@pytest.mark.parametrize("case", list(CASES))
def test_native_kernels_take_the_sinks(case, window, softcap, dtype, monkeypatch):
    """The native CPU kernels themselves (the references made to fail): decode on every ISA variant,
    prefill where the native prefill kernel runs (AVX2 or better); fp32 and bf16 caches."""
    ops = TorchOps(native_cpu=True)
    if not ops.native:
        pytest.skip("native CPU kernels not built")
    step = make_step(*CASES[case])
    step = tuple(t.to(dtype) for t in step[:5]) + step[5:]
    monkeypatch.setattr(ops_module, "paged_decode_attention_torch", _refuse)
    if ops._native.prefill_attention_supported(step[0], step[3]):
        monkeypatch.setattr(TorchOps, "prefill_attention_reference", staticmethod(_refuse))
    sinks = SINKS.to(dtype)
    got, want = run_layer(ops, window, softcap, step, sinks)
    tolerance = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.double(), want, **tolerance)


@pytest.mark.parametrize("window,softcap", [(None, None), (4, None), (16, 3.0)])
@pytest.mark.parametrize("case", ["fresh", "chunk_after_cache", "mixed", "decode"])
def test_triton_ops(case, window, softcap):
    from llmctl.layers.triton_ops import TritonOps

    got, want = run_layer(TritonOps(), window, softcap, make_step(*CASES[case]))
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("case", ["mixed", "chunk_after_cache", "fresh"])
@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_quantized_kv(kind, case, window, native):
    """8-bit KV: store, then the references over what the blocks dequantize to."""
    step = make_step(*CASES[case])
    query, key, value, _, _, meta, seq_lens, new_positions, tables = step
    layer = _quantized_layer(kind, step)
    if native and not layer.cache.native_codes:
        pytest.skip("native 8-bit KV kernels not built")
    layer.cache.native_codes = native
    layer.cache.native_decode = native and layer.cache.native_decode
    attn = Attention(HQ, HKV, D, SCALE, ops=TorchOps(native_cpu=native), sliding_window=window, sinks=SINKS)
    attn.quantized_kv = layer
    got = attn(query, key, value, meta).view(-1, HQ, D)

    def read(table, length):
        keys, values = layer.gather(table[None], length, torch.float32)
        return keys[0], values[0]

    want = expected(query, read, seq_lens, new_positions, tables, window, None, SINKS)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


def test_quantized_kv_triton_ops():
    from llmctl.layers.triton_ops import TritonOps

    step = make_step(*CASES["mixed"])
    query, key, value, _, _, meta, seq_lens, new_positions, tables = step
    layer = _quantized_layer("int8", step)
    layer.cache.native_codes = layer.cache.native_decode = False
    attn = Attention(HQ, HKV, D, SCALE, ops=TritonOps(), sliding_window=4, sinks=SINKS)
    attn.quantized_kv = layer
    got = attn(query, key, value, meta).view(-1, HQ, D)

    def read(table, length):
        keys, values = layer.gather(table[None], length, torch.float32)
        return keys[0], values[0]

    torch.testing.assert_close(
        got.double(), expected(query, read, seq_lens, new_positions, tables, 4, None, SINKS), atol=2e-5, rtol=1e-5
    )


def test_kivi_cache_refuses_sinks():
    step = make_step(*CASES["mixed"])
    query, key, value, *_, meta = step[:6]
    fmt = KVFormat("kivi4", 1, HKV, D, BS, torch.float32)
    cache = QuantizedKVCache(fmt, 16, 4, torch.device("cpu"))
    attn = Attention(HQ, HKV, D, SCALE, ops=TorchOps(), sinks=SINKS)
    attn.quantized_kv = cache.layer(0)
    with pytest.raises(UnsupportedModelError, match="attention sinks"):
        attn(query, key, value, meta)


def test_very_negative_sinks_are_plain_attention():
    """A sink at -inf takes no mass: the layer is the plain causal one (the SDPA path)."""
    step = make_step(*CASES["mixed"])
    query, key, value, key_cache, value_cache, meta = step[:6]
    plain = Attention(HQ, HKV, D, SCALE, ops=TorchOps(native_cpu=False), sliding_window=4)
    sunk = Attention(HQ, HKV, D, SCALE, ops=TorchOps(native_cpu=False), sliding_window=4, sinks=torch.full((HQ,), -1e4))
    outs = []
    for layer in (plain, sunk):
        layer.key_cache, layer.value_cache = key_cache.clone(), value_cache.clone()
        outs.append(layer(query, key, value, meta))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)


def test_masked_attention_matches_transformers_eager():
    """``masked_attention`` with sinks against transformers' gpt-oss eager attention itself."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, HQ, 7, D, generator=gen)
    k, v = torch.randn(1, HKV, 7, D, generator=gen), torch.randn(1, HKV, 7, D, generator=gen)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    additive = torch.zeros(7, 7).masked_fill(~causal, torch.finfo(torch.float32).min)[None, None]
    module = SimpleNamespace(num_key_value_groups=HQ // HKV, sinks=SINKS, training=False)
    want, _ = eager_attention_forward(module, q, k, v, additive, SCALE)  # [1, L, Hq, D]
    got = masked_attention(q, k, v, causal, SCALE, sinks=SINKS).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


class _RecordingOps(TorchOps):
    def __init__(self) -> None:
        super().__init__(native_cpu=False)
        self.kwargs: list[dict] = []

    def prefill_attention(self, *args, **kwargs):
        self.kwargs.append(kwargs)
        return super().prefill_attention(*args, **kwargs)

    def decode_attention(self, *args, **kwargs):
        self.kwargs.append(kwargs)
        return super().decode_attention(*args, **kwargs)


def test_layers_without_sinks_call_the_ops_as_before():
    """``sinks=None``: the ops see no sinks argument at all (the plain path is unchanged)."""
    step = make_step(*CASES["mixed"])
    query, key, value, key_cache, value_cache, meta = step[:6]
    ops = _RecordingOps()
    layer = Attention(HQ, HKV, D, SCALE, ops=ops)
    layer.key_cache, layer.value_cache = key_cache, value_cache
    layer(query, key, value, meta)
    assert ops.kwargs == [{}, {}]
    sunk = Attention(HQ, HKV, D, SCALE, ops=ops, sinks=SINKS)
    sunk.key_cache, sunk.value_cache = key_cache, value_cache
    sunk(query, key, value, meta)
    assert [set(k) for k in ops.kwargs[2:]] == [{"sinks"}, {"sinks"}]


def test_sinks_argument():
    assert Attention(HQ, HKV, D, SCALE, ops=TorchOps()).sinks is None
    assert "sinks" in repr(Attention(HQ, HKV, D, SCALE, ops=TorchOps(), sinks=SINKS))
    with pytest.raises(ValueError, match="one logit per query head"):
        Attention(HQ, HKV, D, SCALE, ops=TorchOps(), sinks=torch.zeros(HQ + 1))
