"""TritonOps against TorchOps on a mixed prefill + decode step, and backend selection."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_testing import DEVICE, assert_close

from llmctl.layers.backends import select_ops
from llmctl.layers.ops import AttentionMetadata, TorchOps


@pytest.mark.no_device
def test_select_ops():
    from llmctl.layers.triton_ops import TritonOps

    ops = select_ops("triton", torch.device("cpu"))
    assert isinstance(ops, TritonOps) and ops.name == "triton"
    auto = select_ops("auto", torch.device("cpu"))
    assert type(auto) is TorchOps and auto.name == "torch"
    assert isinstance(select_ops("auto", torch.device("cuda")), TritonOps)
    assert type(select_ops("torch", torch.device("cuda"))) is TorchOps
    with pytest.raises(ValueError):
        select_ops("cutlass", torch.device("cpu"))


def _step(
    ctx_lens, q_lens, decode_lens, block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32
):
    """One engine step: prefill chunks (with cached prefixes ``ctx_lens``) then decodes.

    Returns the inputs and metadata plus caches already holding every prefix token."""
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)] + list(decode_lens)
    blocks = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks).tolist()
    width = max(blocks)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    it = iter(perm)
    for i, nb in enumerate(blocks):
        tables[i, :nb] = torch.tensor([next(it) for _ in range(nb)], dtype=torch.int32)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape).to(dtype)
    value_cache = torch.randn(shape).to(dtype)

    # this step's tokens: the prefill chunks' tokens, then one token per decode
    new_positions = [list(range(c, c + q)) for c, q in zip(ctx_lens, q_lens)] + [[n - 1] for n in decode_lens]
    slots = []
    for i, positions in enumerate(new_positions):
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in positions]
    num_tokens = len(slots)
    slots.append(-1)  # a padding token at the end of the batch (e.g. a CUDA-graph bucket)
    num_prefill_tokens = sum(q_lens)
    n_pre = len(q_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_prefills=n_pre,
        num_prefill_tokens=num_prefill_tokens,
        num_decodes=len(decode_lens),
        prefill_query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
        prefill_seq_lens=torch.tensor(seq_lens[:n_pre], dtype=torch.int32),
        prefill_block_tables=tables[:n_pre],
        prefill_is_fresh=all(c == 0 for c in ctx_lens),
        decode_seq_lens=torch.tensor(seq_lens[n_pre:], dtype=torch.int32),
        decode_block_tables=tables[n_pre:],
        max_decode_seq_len=max(decode_lens, default=0),
    )
    for name in (
        "slot_mapping",
        "prefill_query_start_loc",
        "prefill_seq_lens",
        "prefill_block_tables",
        "decode_seq_lens",
        "decode_block_tables",
    ):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    total = num_tokens + 1
    query = torch.randn(total, num_q_heads, head_dim).to(dtype).to(DEVICE)
    key = torch.randn(total, num_kv_heads, head_dim).to(dtype).to(DEVICE)
    value = torch.randn(total, num_kv_heads, head_dim).to(dtype).to(DEVICE)
    return query, key, value, key_cache.to(DEVICE), value_cache.to(DEVICE), meta


def _attention_layer(ops, query, key, value, key_cache, value_cache, meta, scale):
    """What a model's attention layer does with the ops: store this step's K/V, then attend."""
    ops.store_kv(key, value, key_cache, value_cache, meta.slot_mapping)
    n = meta.num_prefill_tokens
    parts = []
    if meta.num_prefills:
        parts.append(ops.prefill_attention(query[:n], key[:n], value[:n], key_cache, value_cache, meta, scale))
    if meta.num_decodes:
        q = query[n : n + meta.num_decodes]
        parts.append(ops.decode_attention(q, key_cache, value_cache, meta, scale))
    return torch.cat(parts)


@pytest.mark.parametrize(
    "ctx_lens,q_lens,decode_lens",
    [
        ([0, 0], [9, 20], [5, 40, 1]),  # fresh prompts (contiguous K/V path) + decodes
        ([17, 0], [6, 12], [33, 2]),  # a chunk with a cached prefix (paged path)
        ([], [], [1, 16, 17, 64]),  # decode only
        ([0], [13], []),  # prefill only
    ],
    ids=["fresh+decode", "extend+decode", "decode-only", "prefill-only"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_ops_match_torch_ops(ctx_lens, q_lens, decode_lens, dtype):
    from llmctl.layers.triton_ops import TritonOps

    query, key, value, key_cache, value_cache, meta = _step(ctx_lens, q_lens, decode_lens, dtype=dtype)
    kc_t, vc_t = key_cache.clone(), value_cache.clone()
    expected = _attention_layer(TorchOps(), query, key, value, key_cache, value_cache, meta, 0.17)
    actual = _attention_layer(TritonOps(), query, key, value, kc_t, vc_t, meta, 0.17)
    assert torch.equal(kc_t, key_cache) and torch.equal(vc_t, value_cache)
    assert_close(actual, expected, dtype)


def test_triton_ops_elementwise_delegation():
    from llmctl.layers.triton_ops import TritonOps

    t, r = TorchOps(), TritonOps()
    x = torch.randn(4, 48, device=DEVICE)
    res = torch.randn(4, 48, device=DEVICE)
    w = torch.randn(48, device=DEVICE)
    for a, b in zip(t.rms_norm(x, w, 1e-6, res), r.rms_norm(x, w, 1e-6, res)):
        assert_close(b, a, torch.float32, (1e-5, 1e-5))
    g = torch.randn(4, 96, device=DEVICE)
    assert_close(r.silu_and_mul(g), t.silu_and_mul(g), torch.float32, (1e-5, 1e-5))
    cache = torch.randn(64, 16, device=DEVICE)
    pos = torch.arange(4, device=DEVICE)
    q, k = torch.randn(4, 2, 16, device=DEVICE), torch.randn(4, 1, 16, device=DEVICE)
    for a, b in zip(t.rotary_embedding(pos, q, k, cache), r.rotary_embedding(pos, q, k, cache)):
        assert_close(b, a, torch.float32, (1e-5, 1e-5))


@pytest.mark.no_device
@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """Lower the main kernel variants to sm_90 cubins with the toolchain in Triton's wheel (no GPU
    needed): catches code the interpreter accepts but the GPU compiler rejects."""
    if DEVICE.type == "cuda":
        pytest.skip("on a GPU every test compiles its kernels for real")
    script = Path(__file__).with_name("sm90_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, str(script), "--quick"], capture_output=True, text=True, env=env, timeout=600
    )
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this Triton wheel ships no ptxas")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "compiled" in proc.stdout
    # no kernel variant may spill registers (spills live in the stack frame)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert lines and all("stack=0 " in line for line in lines), proc.stdout
