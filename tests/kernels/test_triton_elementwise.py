"""KV store, RMSNorm, rotary embedding and SiLU-and-mul: Triton kernels against the torch references.

These kernels round every intermediate where the reference does, so on the interpreter fp16/bf16
results are expected bit-identical in nearly every element; the tolerances allow one rounding
step of the output dtype (fp32 sums may be ordered differently).
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, assert_close

from llmctl_kernels.activation import silu_and_mul_torch, silu_and_mul_triton
from llmctl_kernels.kv_store import reshape_and_cache_torch, reshape_and_cache_triton
from llmctl_kernels.rms_norm import rms_norm_torch, rms_norm_triton
from llmctl_kernels.rotary import rotary_embedding_torch, rotary_embedding_triton

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
ULP_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}  # ~2 ulps


# ---------------------------------------------------------------------------------------------- KV store


@DTYPES
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (1, 128), (3, 8)])
def test_reshape_and_cache(dtype, block_size, num_kv_heads, head_dim):
    num_blocks, num_tokens = 6, 13
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(DEVICE)
    value = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 7, 12]] = -1  # padding tokens are skipped
    slots = slots.to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc_ref = torch.randn(shape).to(dtype).to(DEVICE)
    vc_ref = torch.randn(shape).to(dtype).to(DEVICE)
    kc, vc = kc_ref.clone(), vc_ref.clone()
    reshape_and_cache_torch(key, value, kc_ref, vc_ref, slots)
    reshape_and_cache_triton(key, value, kc, vc, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_reshape_and_cache_strided_input_and_cast():
    # K/V as views of a fused qkv output, fp32 into a bf16 cache, int32 slots
    qkv = torch.randn(9, 4 + 2 + 2, 32, device=DEVICE)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([5, -1, 0, 63, 17, 18, 40, -1, 1], dtype=torch.int32, device=DEVICE)
    kc_ref = torch.zeros(4, 16, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    vc_ref = torch.zeros_like(kc_ref)
    kc, vc = kc_ref.clone(), vc_ref.clone()
    reshape_and_cache_torch(key, value, kc_ref, vc_ref, slots)
    reshape_and_cache_triton(key, value, kc, vc, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_reshape_and_cache_all_padding():
    kc = torch.zeros(2, 16, 1, 16, device=DEVICE)
    vc = torch.zeros_like(kc)
    key = torch.randn(3, 1, 16, device=DEVICE)
    reshape_and_cache_triton(key, key, kc, vc, torch.full((3,), -1, device=DEVICE))
    assert not kc.any() and not vc.any()


# ----------------------------------------------------------------------------------------------- RMSNorm


@DTYPES
@pytest.mark.parametrize("hidden", [64, 96, 1000])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(dtype, hidden, with_residual):
    x = (torch.randn(7, hidden) * 3).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype).to(DEVICE)
    residual = torch.randn(7, hidden).to(dtype).to(DEVICE) if with_residual else None
    out_ref, res_ref = rms_norm_torch(x, weight, 1e-6, residual)
    out, res = rms_norm_triton(x, weight, 1e-6, residual)
    assert_close(out, out_ref, dtype, ULP_TOL[dtype])
    if with_residual:
        assert torch.equal(res, res_ref)  # x + residual in the input dtype: exact
    else:
        assert res is x


def test_rms_norm_fp32_weight_bf16_input_and_3d():
    x = torch.randn(3, 4, 32).to(torch.bfloat16).to(DEVICE)  # e.g. a per-head q-norm
    weight = torch.randn(32, device=DEVICE)
    out_ref, _ = rms_norm_torch(x, weight, 1e-5)
    out, _ = rms_norm_triton(x, weight, 1e-5)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert_close(out, out_ref, torch.float32, (1e-5, 1e-5))
    residual = torch.randn(3, 4, 32, device=DEVICE)  # mixed dtypes promote like torch
    out_ref, res_ref = rms_norm_torch(x, weight, 1e-5, residual)
    out, res = rms_norm_triton(x, weight, 1e-5, residual)
    assert res.dtype == res_ref.dtype and torch.equal(res, res_ref)
    assert_close(out, out_ref, torch.float32, (1e-5, 1e-5))


# ------------------------------------------------------------------------------------------------ rotary


def _cos_sin_cache(rotary_dim: int, max_pos: int, llama3: bool = False) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    if llama3:  # a crude frequency-dependent rescale, baked into the cache like llama3's
        inv_freq = torch.where(inv_freq < 0.05, inv_freq / 8, inv_freq)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)


@DTYPES
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim,rotary_dim",
    [(4, 2, 64, 64), (8, 1, 128, 128), (4, 4, 64, 32), (2, 1, 80, 48), (3, 1, 8, 8)],
    ids=["gqa-64", "mqa-128", "partial-32of64", "partial-48of80", "tiny-8"],
)
def test_rotary_embedding(dtype, num_q_heads, num_kv_heads, head_dim, rotary_dim):
    num_tokens = 9
    cache = _cos_sin_cache(rotary_dim, 4096, llama3=True)
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    query = torch.randn(num_tokens, num_q_heads, head_dim).to(dtype).to(DEVICE)
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(DEVICE)
    q_ref, k_ref = rotary_embedding_torch(positions, query, key, cache)
    q, k = rotary_embedding_triton(positions, query, key, cache)
    assert_close(q, q_ref, dtype, ULP_TOL[dtype])
    assert_close(k, k_ref, dtype, ULP_TOL[dtype])


def test_rotary_embedding_strided_views():
    qkv = torch.randn(5, 4 + 2 + 2, 64, device=DEVICE)
    query, key = qkv[:, :4], qkv[:, 4:6]
    cache = _cos_sin_cache(64, 128)
    positions = torch.tensor([0, 1, 2, 100, 127], dtype=torch.int32, device=DEVICE)
    q_ref, k_ref = rotary_embedding_torch(positions, query, key, cache)
    q, k = rotary_embedding_triton(positions, query, key, cache)
    assert_close(q, q_ref, torch.float32, ULP_TOL[torch.float32])
    assert_close(k, k_ref, torch.float32, ULP_TOL[torch.float32])


# ------------------------------------------------------------------------------------------ SiLU-and-mul


@DTYPES
@pytest.mark.parametrize("d", [8, 100, 1500])
def test_silu_and_mul(dtype, d):
    x = (torch.randn(5, 2 * d) * 4).to(dtype).to(DEVICE)
    assert_close(silu_and_mul_triton(x), silu_and_mul_torch(x), dtype, ULP_TOL[dtype])


def test_silu_and_mul_3d_and_empty():
    x = torch.randn(2, 3, 64, device=DEVICE)
    assert_close(silu_and_mul_triton(x), silu_and_mul_torch(x), torch.float32, ULP_TOL[torch.float32])
    assert silu_and_mul_triton(x[:0]).shape == (0, 3, 32)
