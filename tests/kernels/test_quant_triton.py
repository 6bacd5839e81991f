"""The Triton quantized GEMM against the torch reference (dequantize, then matmul).

Tolerance: fp32 activations give the reference's float products in another summation order (the
interpreter multiplies in numpy); on a GPU bf16/fp16 activations meet weights rounded to the same
dtype on the tensor cores, so those compare at that dtype's precision.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE

from llmctl.layers.quantization.quantize import quantize_fp8, quantize_int4, quantize_int8
from llmctl_kernels.packed_formats import PackedInt8
from llmctl_kernels.quant_linear import quant_linear_torch
from llmctl_kernels.quant_triton import quant_linear_triton

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _packed(kind: str, n: int, k: int):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k))
    if kind == "int4g32":
        p = quantize_int4(w, 32)
    elif kind == "int8":
        p = quantize_int8(w)
    elif kind == "int8g16-mins":  # the asymmetric int8 layout GGUF's K-quants become
        s = quantize_int8(w, 16)
        p = PackedInt8(s.qweight, s.scales, torch.randn(n, k // 16) * 0.1, 16)
    else:
        p = quantize_fp8(w)
    for name in ("qweight", "scales", "mins"):
        if getattr(p, name, None) is not None:
            setattr(p, name, getattr(p, name).to(DEVICE))
    return p


@pytest.mark.parametrize("kind", ["int4g32", "int8", "int8g16-mins", "fp8"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 64), (5, 40, 96), (17, 24, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(kind, m, n, k, dtype):
    packed = _packed(kind, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    got = quant_linear_triton(x, packed)
    expected = quant_linear_torch(x, packed)
    assert got.dtype == dtype and got.shape == (m, n)
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL[dtype] * scale, rtol=TOL[dtype])


def test_fp8_decoding_covers_every_byte():
    """All 254 finite e4m3fn patterns (subnormals, both signs) decode as torch does."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[~codes.view(torch.float8_e4m3fn).float().isnan()]
    k = 16 * ((finite.numel() + 15) // 16)
    q = torch.zeros(1, k, dtype=torch.uint8)
    q[0, : finite.numel()] = finite
    from llmctl_kernels.packed_formats import PackedFp8

    packed = PackedFp8(q.repeat(16, 1).to(DEVICE), torch.ones(16, device=DEVICE))
    eye = torch.eye(k, device=DEVICE)  # x = identity: y[i, n] = w[n, i]
    got = quant_linear_triton(eye, packed)[:, 0].cpu()
    torch.testing.assert_close(got, q[0].view(torch.float8_e4m3fn).float(), atol=0, rtol=0)
