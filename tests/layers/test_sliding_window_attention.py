"""Sliding-window attention and attention-logit soft-capping on every attention backend, against a
dense masked reference written out here: a query at position q sees the keys k with
q - window < k <= q (transformers' sliding_window_overlay), each score s = q.k * scale becoming
softcap * tanh(s / softcap) before the mask (Gemma 2's eager attention)."""

from __future__ import annotations

import itertools

import pytest
import torch
from kv_pool_factory import filled_pool

from llmctl.engine.kv_cache import KVFormat, QuantizedKVCache
from llmctl.layers.attention import Attention
from llmctl.layers.ops import AttentionMetadata, TorchOps
from llmctl_kernels import kv_quant as kq
from llmctl_kernels.cpu_native import load_native
from llmctl_kernels.decode_attention import paged_decode_attention_triton
from llmctl_kernels.kv_quant_native import load_kv_quant_native, quantized_decode_attention_native

HQ, HKV, D, BS, SCALE = 4, 2, 64, 16, 0.125
WINDOWS = [None, 1, 4, 16, 500]  # 500: longer than every sequence here
SOFTCAPS = [None, 3.0]
CASES = {  # (cached context, prefill chunk) per prefill, then the decodes' lengths
    "fresh": ([0, 0], [9, 40], []),
    "chunk_after_cache": ([37, 0], [20, 5], []),
    "mixed": ([17, 0], [6, 30], [5, 40, 1, 70]),
    "decode": ([], [], [1, 16, 17, 70]),
}
needs_native = pytest.mark.skipif(load_native() is None, reason="native CPU kernels not built")


def dense_reference(query, keys, values, positions, scale, window, softcap):
    """query [Lq, Hq, D] at ``positions`` over keys/values [L, Hkv, D] (positions 0..L-1), in float64."""
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
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def make_step(ctx_lens, q_lens, decode_lens, dtype=torch.float32, seed=0):
    """Caches holding every earlier token, this step's q/k/v and metadata (prefills first)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)] + list(decode_lens)
    blocks = [-(-n // BS) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    perm = iter(torch.randperm(num_blocks, generator=gen).tolist())
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    for i, nb in enumerate(blocks):
        tables[i, :nb] = torch.tensor([next(perm) for _ in range(nb)], dtype=torch.int32)
    shape = (num_blocks, BS, HKV, D)
    key_cache, value_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    new_positions = [list(range(c, c + q)) for c, q in zip(ctx_lens, q_lens)] + [[n - 1] for n in decode_lens]
    slots = [int(tables[i, p // BS]) * BS + p % BS for i, ps in enumerate(new_positions) for p in ps]
    n_pre = len(q_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_prefills=n_pre,
        num_prefill_tokens=sum(q_lens),
        num_decodes=len(decode_lens),
        prefill_query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
        prefill_seq_lens=torch.tensor(seq_lens[:n_pre], dtype=torch.int32),
        prefill_block_tables=tables[:n_pre],
        prefill_is_fresh=all(c == 0 for c in ctx_lens),
        decode_seq_lens=torch.tensor(seq_lens[n_pre:], dtype=torch.int32),
        decode_block_tables=tables[n_pre:],
        max_decode_seq_len=max(decode_lens, default=0),
    )
    t = len(slots)
    query = torch.randn(t, HQ, D, generator=gen).to(dtype)
    key = torch.randn(t, HKV, D, generator=gen).to(dtype)
    value = torch.randn(t, HKV, D, generator=gen).to(dtype)
    return query, key, value, key_cache, value_cache, meta, seq_lens, new_positions, tables


def expected(query, read_kv, seq_lens, new_positions, tables, window, softcap):
    """The dense reference per sequence; ``read_kv(table_row, length)`` -> its keys/values [L, Hkv, D]."""
    out, row = torch.empty(query.shape, dtype=torch.float64), 0
    for i, positions in enumerate(new_positions):
        keys, values = read_kv(tables[i], seq_lens[i])
        n = len(positions)
        out[row : row + n] = dense_reference(query[row : row + n], keys, values, positions, SCALE, window, softcap)
        row += n
    return out


def float_cache_reader(key_cache, value_cache):
    def read(table, length):
        idx = [int(table[t // BS]) * BS + t % BS for t in range(length)]
        return key_cache.flatten(0, 1)[idx].float(), value_cache.flatten(0, 1)[idx].float()

    return read


def run_layer(ops, window, softcap, step):
    query, key, value, key_cache, value_cache, meta, seq_lens, new_positions, tables = step
    layer = Attention(HQ, HKV, D, SCALE, ops=ops, sliding_window=window, logit_softcap=softcap)
    layer.key_cache, layer.value_cache = key_cache, value_cache
    got = layer(query, key, value, meta).view(-1, HQ, D)
    want = expected(query, float_cache_reader(key_cache, value_cache), seq_lens, new_positions, tables, window, softcap)
    return got, want


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", list(CASES))
def test_torch_reference(case, window, softcap):
    got, want = run_layer(TorchOps(native_cpu=False), window, softcap, make_step(*CASES[case]))
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", list(CASES))
def test_native_cpu(case, window, softcap):
    got, want = run_layer(TorchOps(native_cpu=True), window, softcap, make_step(*CASES[case]))
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("window,softcap", [(None, None), (4, None), (16, 3.0), (1, 3.0)])
@pytest.mark.parametrize("case", ["mixed", "chunk_after_cache"])
def test_native_cpu_bf16(case, window, softcap):
    """bf16 caches: the prefill tiles and (on AVX512-BF16 CPUs) the vdpbf16ps decode kernel."""
    got, want = run_layer(TorchOps(native_cpu=True), window, softcap, make_step(*CASES[case], dtype=torch.bfloat16))
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("window,softcap", [(None, None), (1, None), (16, None), (5, 3.0), (500, 3.0)])
@pytest.mark.parametrize("case", ["fresh", "chunk_after_cache", "mixed"])
def test_triton(case, window, softcap):
    from llmctl.layers.triton_ops import TritonOps

    got, want = run_layer(TritonOps(), window, softcap, make_step(*CASES[case]))
    torch.testing.assert_close(got.double(), want, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("window,softcap", [(1, None), (20, None), (40, 3.0), (None, 3.0)])
def test_triton_split_decode(window, softcap):
    """Split-K decode: partitions wholly before the window stay empty and merge as nothing."""
    query, _, _, key_cache, value_cache, meta, seq_lens, new_positions, tables = make_step([], [], [1, 70, 130, 200])
    got = paged_decode_attention_triton(
        query,
        key_cache,
        value_cache,
        meta.decode_block_tables,
        meta.decode_seq_lens,
        SCALE,
        num_splits=4,
        block_n=16,
        window=window,
        softcap=softcap,
    )
    want = expected(query, float_cache_reader(key_cache, value_cache), seq_lens, new_positions, tables, window, softcap)
    torch.testing.assert_close(got.double(), want, atol=5e-5, rtol=1e-4)


def _quantized_layer(kind, step):
    """A one-layer quantized pool (``kind``) holding the step's earlier tokens, as stored codes."""
    query, key, value, key_cache, value_cache, meta, seq_lens, new_positions, tables = step
    fmt = KVFormat(kind, 1, HKV, D, BS, torch.float32)
    cache = QuantizedKVCache(fmt, key_cache.shape[0], 0, torch.device("cpu"))
    cache.zero_blocks(0, cache.num_blocks)
    layer = cache.layer(0)
    all_slots = torch.arange(key_cache.shape[0] * BS)
    layer.store(key_cache.flatten(0, 1), value_cache.flatten(0, 1), all_slots)  # every earlier token
    return layer


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("window,softcap", [(None, None), (1, None), (16, None), (4, 3.0), (500, 3.0)])
@pytest.mark.parametrize("case", ["mixed", "chunk_after_cache", "fresh"])
@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_quantized_kv(kind, case, window, softcap, native):
    """8-bit KV: the layer against the dense reference over the dequantized cache (what the codes
    hold), on the native codes kernels and on the torch reference."""
    step = make_step(*CASES[case])
    query, key, value, _, _, meta, seq_lens, new_positions, tables = step
    layer = _quantized_layer(kind, step)
    if native and not layer.cache.native_codes:
        pytest.skip("native 8-bit KV kernels not built")
    layer.cache.native_codes = native
    layer.cache.native_decode = native and layer.cache.native_decode
    attn = Attention(HQ, HKV, D, SCALE, ops=TorchOps(native_cpu=native), sliding_window=window, logit_softcap=softcap)
    attn.quantized_kv = layer
    got = attn(query, key, value, meta).view(-1, HQ, D)

    def read(table, length):
        keys, values = layer.gather(table[None], length, torch.float32)
        return keys[0], values[0]

    want = expected(query, read, seq_lens, new_positions, tables, window, softcap)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(load_kv_quant_native() is None, reason="native quantized-KV kernels not built")
@pytest.mark.parametrize("window,softcap", [(1, None), (7, None), (20, 3.0), (None, 3.0), (500, None)])
@pytest.mark.parametrize("kind,head_dim", [("int8", 32), ("fp8_e5m2", 64), ("kivi4", 64), ("kivi2", 32)])
def test_quantized_decode_native(kind, head_dim, window, softcap):
    """The quantized-KV module's decode kernel (KIVI, and 8-bit at head sizes the codes kernel does
    not take), generic and AVX2 variants, against the torch reference over the same pool."""
    lens = [1, 9, 33, 70]
    layer, table, seq_lens = filled_pool(kind, lens, head_dim=head_dim, residual_tokens=16 if "kivi" in kind else 0)
    query = torch.randn(len(lens), 4, head_dim)
    kwargs = dict(value_group=layer.fmt.value_group, residual=layer.residual)
    if layer.fmt.is_kivi:
        kwargs["residual_table"] = layer.cache.plan.residual_table
    got = quantized_decode_attention_native(
        query, kind, layer.t, table, seq_lens, SCALE, window=window, softcap=softcap, **kwargs
    )
    keys, values = layer.gather(table, int(seq_lens.max()), torch.float32)
    want = kq.decode_attention_dense(query, keys, values, seq_lens, SCALE, window, softcap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    dense = torch.stack(
        [
            dense_reference(query[i : i + 1], keys[i, :n], values[i, :n], [n - 1], SCALE, window, softcap)[0]
            for i, n in enumerate(lens)
        ]
    )
    torch.testing.assert_close(want.double(), dense, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window,softcap", [(3, None), (16, 3.0)])
def test_kivi_prefill_reference(window, softcap):
    """KIVI's causal reference honours the model's window and cap on top of its own residual groups:
    with every token exact it is the dense reference."""
    keys, values = torch.randn(40, HKV, D), torch.randn(40, HKV, D)
    query = torch.randn(12, HQ, D)
    got = kq.attend_causal_kivi(query, keys, values, keys, values, BS, SCALE, window, softcap)
    want = dense_reference(query, keys, values, list(range(28, 40)), SCALE, window, softcap)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


def test_attention_arguments():
    layer = Attention(HQ, HKV, D, SCALE, ops=TorchOps())
    assert layer.sliding_window is None and layer.logit_softcap is None
    assert "sliding_window=8" in repr(Attention(HQ, HKV, D, SCALE, ops=TorchOps(), sliding_window=8))
    with pytest.raises(ValueError):
        Attention(HQ, HKV, D, SCALE, ops=TorchOps(), sliding_window=0)
    with pytest.raises(ValueError):
        Attention(HQ, HKV, D, SCALE, ops=TorchOps(), logit_softcap=0.0)
