"""Triton kernels over the quantized KV cache against the torch references (kernels/kv_quant.py,
llmctl/engine/kv_cache.py): quantize-on-store bit for bit, and attention within float tolerance
over the same quantized blocks, for every ``--kv-cache-dtype``.

Caches are filled the way the engine fills them: steps of a few tokens per sequence through the
reference store (``begin_step`` + ``store``), so KIVI blocks are quantized as they close and open
blocks sit in the residual pool; block tables are scattered over a pool with spare blocks.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from kernel_testing import DEVICE, assert_close

from llmctl.engine.kv_cache import KVFormat, QuantizedKVCache
from llmctl.layers.ops import AttentionMetadata, TorchOps
from llmctl_kernels import kv_quant as kq
from llmctl_kernels.decode_attention import paged_decode_attention_quantized_triton
from llmctl_kernels.kv_store import kivi_quantize_blocks_triton, quantize_and_cache_triton
from llmctl_kernels.prefill_attention import paged_prefill_attention_quantized_triton

QUANTIZED = [k for k in kq.KV_CACHE_DTYPES if k != "auto"]


def _kv(n: int, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Random K/V rows with a per-row magnitude and an outlier channel (as keys have)."""
    x = torch.randn(n, heads, dim) * 10 ** (torch.rand(n, heads, 1) * 2 - 1)
    x[..., 1] *= 8
    return x.to(dtype).to(DEVICE)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class Scene:
    """A quantized one-layer pool holding ``history[i]`` tokens of sequence ``i`` (written by the
    reference store ``chunk`` tokens per step), and the step that writes ``new[i]`` more."""

    def __init__(
        self,
        kind,
        history,
        new,
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        group_size=32,
        chunk=5,
        num_prefills=None,
    ):
        self.kind, self.dtype, self.block_size = kind, dtype, block_size
        self.num_prefills = len(new) if num_prefills is None else num_prefills
        self.seq_lens = [h + n for h, n in zip(history, new)]
        blocks = [-(-n // block_size) for n in self.seq_lens]
        num_blocks = sum(blocks) + 3
        perm = torch.randperm(num_blocks).tolist()
        self.tables = torch.full((len(blocks), max(blocks) + 1), perm[-1], dtype=torch.int32)  # padded, valid ids
        used = 0
        for i, nb in enumerate(blocks):
            self.tables[i, :nb] = torch.tensor(perm[used : used + nb])
            used += nb
        fmt = KVFormat(kind, 1, num_kv_heads, head_dim, block_size, dtype, group_size)
        self.cache = QuantizedKVCache(fmt, num_blocks, len(blocks) + 1, DEVICE)
        self.cache.zero_blocks(0, num_blocks)
        for start in range(0, max(history), chunk):  # history, a few tokens per sequence per step
            positions = [(i, p) for i, h in enumerate(history) for p in range(start, min(start + chunk, h))]
            self._write(positions)
        self.positions = [(i, p) for i, (h, n) in enumerate(zip(history, new)) for p in range(h, h + n)]
        self.slots = self._slots(self.positions)
        self.query = torch.randn(len(self.positions), num_q_heads, head_dim).to(dtype).to(DEVICE)
        self.key = _kv(len(self.positions), num_kv_heads, head_dim, dtype)
        self.value = _kv(len(self.positions), num_kv_heads, head_dim, dtype)
        self.scale = head_dim**-0.5

    def _slots(self, positions) -> list[int]:
        bs = self.block_size
        return [int(self.tables[i, p // bs]) * bs + p % bs for i, p in positions]

    def _write(self, positions) -> None:
        slots = self._slots(positions)
        fmt = self.cache.fmt
        k, v = (
            _kv(len(slots), fmt.num_kv_heads, fmt.head_dim, self.dtype),
            _kv(len(slots), fmt.num_kv_heads, fmt.head_dim, self.dtype),
        )
        self.cache.begin_step(slots)
        self.cache.layer(0).store(k, v, torch.tensor(slots, device=DEVICE))

    def meta(self) -> AttentionMetadata:
        """The step as the model runner lays it out: prefill chunks first, then one-token decodes."""
        p = self.num_prefills
        loc = [0]
        for i in range(p):
            loc.append(loc[-1] + sum(1 for j, _ in self.positions if j == i))
        lens = torch.tensor(self.seq_lens, dtype=torch.int32, device=DEVICE)
        tables = self.tables.to(DEVICE)
        return AttentionMetadata(
            slot_mapping=torch.tensor(self.slots, device=DEVICE),
            num_prefills=p,
            num_prefill_tokens=loc[-1],
            num_decodes=len(self.seq_lens) - p,
            prefill_query_start_loc=torch.tensor(loc, dtype=torch.int32, device=DEVICE),
            prefill_seq_lens=lens[:p],
            prefill_block_tables=tables[:p],
            prefill_is_fresh=False,
            decode_seq_lens=lens[p:],
            decode_block_tables=tables[p:],
            max_decode_seq_len=max(self.seq_lens[p:], default=0),
        )

    def store_step(self) -> None:
        """Write the step's K/V with the reference store (``begin_step`` + ``store``)."""
        self.cache.begin_step(self.slots)
        self.cache.layer(0).store(self.key, self.value, torch.tensor(self.slots, device=DEVICE))


# ---- store ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", kq.PER_TOKEN_DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 32), (3, 24)], ids=["h2d32", "h3d24"])
def test_store_per_token_matches_reference_bit_for_bit(kind, num_kv_heads, head_dim):
    scene = Scene(kind, [0, 0, 0], [9, 16, 3], num_kv_heads, num_kv_heads, head_dim, 16, torch.float32)
    expected = copy.deepcopy(scene.cache)
    slots = torch.tensor(scene.slots[:-1] + [-1], device=DEVICE)  # the last token is padding: skipped
    key, value = scene.key.clone(), scene.value.clone()
    key[0, 0] = 0.0  # an all-zero row: scale 0, codes 0
    key[1, 0, :4] = torch.tensor([1e-30, -3e-8, 2.5, -7.0])  # fp8 subnormals after scaling
    expected.layer(0).store(key, value, slots)
    quantize_and_cache_triton(key, value, scene.cache.layer(0).t, kind, slots)
    for name, t in scene.cache.tensors.items():
        assert _same_bytes(t, expected.tensors[name]), name


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize(
    "head_dim,group,block_size,heads",
    [(64, 32, 16, 2), (16, 8, 8, 3), (32, 32, 12, 1)],
    ids=["d64g32", "d16g8", "d32bs12"],
)
def test_kivi_block_quantization_matches_reference_bit_for_bit(bits, head_dim, group, block_size, heads):
    fmt = KVFormat(f"kivi{bits}", 1, heads, head_dim, block_size, torch.float32, group)
    cache = QuantizedKVCache(fmt, 5, 1, DEVICE)
    cache.zero_blocks(0, 5)
    staging_k = _kv(4 * block_size, heads, head_dim, torch.float32).view(4, block_size, heads, head_dim)
    staging_v = _kv(4 * block_size, heads, head_dim, torch.float32).view(4, block_size, heads, head_dim)
    staging_k[1, :, 0] = 3.0  # a constant channel group: scale 0
    staging_v[1, 2] = -1.5
    index, blocks = torch.tensor([3, 1, 0], device=DEVICE), torch.tensor([4, 0, 2], device=DEVICE)
    kivi_quantize_blocks_triton(staging_k, staging_v, index, blocks, cache.layer(0).t, bits)
    t = cache.layer(0).t
    expected = (
        *kq.quantize_kivi_keys(staging_k[index], bits),
        *kq.quantize_kivi_values(staging_v[index], bits, fmt.value_group),
    )
    names = ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero")
    for name, want in zip(names, expected):
        assert torch.equal(t[name][blocks], want), name
    assert not t["k"][[1, 3]].any(), "blocks not completed stay untouched"


# ---- decode ----------------------------------------------------------------------------------------
def _decode_reference(scene: Scene, query: torch.Tensor) -> torch.Tensor:
    meta = scene.meta()
    layer = scene.cache.layer(0)
    keys, values = layer.gather(meta.decode_block_tables, max(scene.seq_lens), query.dtype)
    return kq.decode_attention_dense(query, keys, values, meta.decode_seq_lens, scene.scale)


def _decode_triton(scene: Scene, query: torch.Tensor, **kw) -> torch.Tensor:
    meta, layer, plan = scene.meta(), scene.cache.layer(0), scene.cache.plan
    fp = (layer.residual["k"], layer.residual["v"], plan.residual_table) if scene.cache.fmt.is_kivi else None
    return paged_decode_attention_quantized_triton(
        query, layer.t, scene.kind, meta.decode_block_tables, meta.decode_seq_lens, scene.scale, full_precision=fp, **kw
    )


@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("num_splits", [1, 3], ids=["nosplit", "split3"])
def test_decode_matches_reference(kind, num_splits):
    # lengths around block edges (16): 1 token, a block just completed, one just opened, several
    scene = Scene(kind, [0, 15, 16, 44], [1, 1, 1, 1], 4, 2, 32, 16, torch.float32, num_prefills=0)
    scene.store_step()
    query = scene.query
    actual = _decode_triton(scene, query, num_splits=num_splits, block_n=16)
    assert_close(actual, _decode_reference(scene, query), torch.float32)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8", "kivi2", "kivi4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_half_precision_and_mqa(kind, dtype):
    scene = Scene(kind, [21, 7], [1, 1], 4, 1, 64, 8, dtype, num_prefills=0)
    scene.store_step()
    assert_close(_decode_triton(scene, scene.query), _decode_reference(scene, scene.query), dtype)


def test_decode_single_token_returns_the_dequantized_value():
    """Over one token the output is that token's value: dequantization exact to the bit (fp32)."""
    scene = Scene("int8", [0, 0], [1, 1], 2, 2, 16, 16, torch.float32, num_prefills=0)
    scene.store_step()
    layer = scene.cache.layer(0)
    blocks = scene.tables[:, 0].long().to(DEVICE)
    values = kq.dequantize_per_token(layer.t["v"][blocks, 0], layer.t["v_scale"][blocks, 0], torch.float32)
    actual = _decode_triton(scene, scene.query)
    if DEVICE.type == "cpu":
        assert torch.equal(actual, values)
    else:  # tf32x3 dots carry ~22 of fp32's 24 mantissa bits
        assert_close(actual, values, torch.float32)


# ---- prefill ----------------------------------------------------------------------------------------
def _prefill_reference(scene: Scene) -> torch.Tensor:
    """``QuantizedLayerKV.attend``'s prefill half on the stored step."""
    meta, layer, fmt = scene.meta(), scene.cache.layer(0), scene.cache.fmt
    out = []
    loc = meta.prefill_query_start_loc.tolist()
    for i, seq_len in enumerate(meta.prefill_seq_lens.tolist()):
        q = scene.query[loc[i] : loc[i + 1]]
        table = meta.prefill_block_tables[i : i + 1]
        keys, values = layer.gather(table, seq_len, q.dtype)
        if fmt.is_kivi:
            ek, ev = layer.gather_exact(table[0].tolist(), seq_len, q.dtype)
            out.append(kq.attend_causal_kivi(q, keys[0], values[0], ek, ev, fmt.block_size, scene.scale))
        else:
            from llmctl_kernels.prefill_attention import attend_causal

            out.append(attend_causal(q, keys[0], values[0], scene.scale))
    return torch.cat(out)


def _prefill_triton(scene: Scene, **kw) -> torch.Tensor:
    meta, layer, plan = scene.meta(), scene.cache.layer(0), scene.cache.plan
    fp = None
    if scene.cache.fmt.is_kivi:
        table = torch.full((scene.cache.num_blocks,), -1, dtype=torch.int32, device=DEVICE)
        for block, index in plan.staging_of.items():
            table[block] = index
        fp = (plan.staging["k"], plan.staging["v"], table)
        # blocks that stay in the window hold this step's tokens in their residual slots
        kw["residual"] = (layer.residual["k"], layer.residual["v"], plan.residual_table)
    n = meta.num_prefill_tokens
    return paged_prefill_attention_quantized_triton(
        scene.query[:n],
        layer.t,
        scene.kind,
        meta.prefill_block_tables,
        meta.prefill_query_start_loc,
        meta.prefill_seq_lens,
        scene.scale,
        full_precision=fp,
        **kw,
    )


@pytest.mark.parametrize("kind", QUANTIZED)
def test_prefill_over_cached_prefix_matches_reference(kind):
    # fresh prompt, chunk after a partial-block prefix, chunk after whole blocks, a chunk ending on a
    # block edge, and a chunk inside one block (16)
    scene = Scene(kind, [0, 5, 32, 9, 18], [21, 20, 3, 7, 4], 4, 2, 32, 16, torch.float32)
    scene.store_step()
    assert_close(_prefill_triton(scene, block_m=16, block_n=16), _prefill_reference(scene), torch.float32)


@pytest.mark.parametrize("kind", ["fp8_e5m2", "kivi2", "kivi4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_prefill_half_precision_gqa(kind, dtype):
    scene = Scene(kind, [11, 0], [14, 9], 6, 2, 16, 8, dtype)
    scene.store_step()
    assert_close(_prefill_triton(scene), _prefill_reference(scene), dtype)


# ---- the engine's step: TritonOps against TorchOps -------------------------------------------------------
@pytest.mark.parametrize("kind", QUANTIZED)
def test_triton_ops_step_matches_torch_ops(kind):
    """One mixed step (prefill chunks over cached prefixes, then decodes) through
    ``ops.attend_quantized``: same output, and the pool (codes, scales, residual) bit for bit."""
    from llmctl.layers.triton_ops import TritonOps

    scene = Scene(kind, [6, 16, 15, 30, 3], [12, 5, 1, 1, 1], 4, 2, 32, 16, torch.float32, num_prefills=2)
    reference = copy.deepcopy(scene.cache)
    meta, args = scene.meta(), (scene.query, scene.key, scene.value)
    reference.begin_step(scene.slots)
    expected = TorchOps().attend_quantized(reference.layer(0), *args, meta, scene.scale)
    scene.cache.begin_step(scene.slots)
    actual = TritonOps().attend_quantized(scene.cache.layer(0), *args, meta, scene.scale)
    assert_close(actual, expected, torch.float32)
    for name, t in scene.cache.tensors.items():
        assert _same_bytes(t, reference.tensors[name]), name
    for name, t in scene.cache.residual.items():
        assert torch.equal(t, reference.residual[name]), name


@pytest.mark.parametrize("kind", ["kivi2", "kivi4"])
def test_prefill_with_a_multi_block_residual_window(kind):
    """A KIVI residual window of two blocks (``window``): a row reads its window group in full
    precision, from this step's staging (groups the step completes) or else the residual (the group
    still open), every completed group dequantized. Pool state built by hand from the references."""
    bits, bs, window, hkv, hq, dim = kq.KIVI_BITS[kind], 8, 16, 2, 4, 16
    cases = [(5, 20), (16, 9), (3, 4), (0, 16), (20, 13)]  # (cached tokens, chunk tokens)
    seq_lens = [c + q for c, q in cases]
    blocks_of = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(blocks_of) + 2
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(cases), max(blocks_of), dtype=torch.int32)
    fmt = KVFormat(kind, 1, hkv, dim, bs, torch.float32, 8)
    t = {name: torch.zeros(num_blocks, *shape, dtype=dt) for name, (shape, dt) in fmt.tensor_shapes().items()}
    residual = torch.zeros(2, num_blocks, bs, hkv, dim)  # k, v; slot = block id (any slot works)
    residual_table = torch.full((num_blocks,), -1, dtype=torch.int64)
    staging, staging_table = [], torch.full((num_blocks,), -1, dtype=torch.int32)
    queries, expected = [], []
    for s, ((ctx, q_len), seq_len) in enumerate(zip(cases, seq_lens)):
        exact = torch.randn(2, blocks_of[s] * bs, hkv, dim) * 3  # the full-precision K, V of every position
        cached = exact.clone()  # what the cache holds: dequantized groups, full precision in the open group
        for i in range(blocks_of[s]):
            block = perm.pop()
            tables[s, i] = block
            rows = slice(i * bs, (i + 1) * bs)
            group_end = (i * bs // window + 1) * window
            if group_end > seq_len:  # the open group: in the residual
                residual[:, block] = exact[:, rows]
                residual_table[block] = block
                continue
            kb = kq.quantize_kivi_keys(exact[0, rows], bits)
            vb = kq.quantize_kivi_values(exact[1, rows], bits, 8)
            for name, x in zip(("k", "k_scale", "k_zero", "v", "v_scale", "v_zero"), (*kb, *vb)):
                t[name][block] = x
            cached[0, rows] = kq.dequantize_kivi_keys(*kb, bits, torch.float32)
            cached[1, rows] = kq.dequantize_kivi_values(*vb, bits, 8, torch.float32)
            if group_end > ctx:  # completed by this step: staged
                staging_table[block] = len(staging)
                staging.append(exact[:, rows])
        q = torch.randn(q_len, hq, dim)
        queries.append(q)
        expected.append(
            kq.attend_causal_kivi(
                q, cached[0, :seq_len], cached[1, :seq_len], exact[0, :seq_len], exact[1, :seq_len], window, dim**-0.5
            )
        )
    staged = torch.stack(staging, 1)
    loc = torch.tensor([0, *itertools.accumulate(q for _, q in cases)], dtype=torch.int32)
    actual = paged_prefill_attention_quantized_triton(
        torch.cat(queries).to(DEVICE),
        {n: x.to(DEVICE) for n, x in t.items()},
        kind,
        tables.to(DEVICE),
        loc.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        dim**-0.5,
        full_precision=(staged[0].to(DEVICE), staged[1].to(DEVICE), staging_table.to(DEVICE)),
        residual=(residual[0].to(DEVICE), residual[1].to(DEVICE), residual_table.to(DEVICE)),
        window=window,
        block_m=16,
        block_n=16,
    )
    assert_close(actual, torch.cat(expected).to(DEVICE), torch.float32)
