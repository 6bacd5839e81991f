"""Float16 scales and mins for the native int4/int8 kernels (``params.kernel_packed``): where every
value is exactly a float16 (GGUF files), the kernels read the 2-byte copies and must give the very
bits of the float32 ones; where not (on-the-fly quantization), the float32 ones stay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmctl.layers.quantization.params import attach_packed, kernel_packed, weight_bytes
from llmctl.layers.quantization.quantize import quantize_int4
from llmctl_kernels.packed_formats import PackedInt4, PackedInt8
from llmctl_kernels.quant_native import bind_native, native_unavailable_reason

pytestmark = pytest.mark.no_device

if native_unavailable_reason() is not None:
    pytest.skip(f"quantized CPU kernels: {native_unavailable_reason()}", allow_module_level=True)


def _half_exact(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()  # float32 values that are exactly float16 ones, as GGUF's are


def _gguf_like(kind: str, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    scales = _half_exact(torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-6)  # tiny ones: float16 subnormals
    if kind == "int4":
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        return PackedInt4(q, scales, _half_exact(torch.randn(n, k // 32, generator=gen) * 0.1), 32)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    mins = _half_exact(torch.randn(n, k // 32, generator=gen) * 0.1) if kind == "int8-mins" else None
    return PackedInt8(q, scales, mins, 32)


def _layer(packed) -> nn.Module:
    layer = nn.Module()
    attach_packed(layer, packed, torch.device("cpu"))
    return layer


@pytest.mark.parametrize("kind", ["int4", "int8", "int8-mins"])
@pytest.mark.parametrize("m", [1, 4, 9])
def test_half_scales_give_the_float32_bits(kind, m):
    packed = _gguf_like(kind, 36, 192, seed=m)
    layer = _layer(packed)
    half = kernel_packed(layer)
    assert half.scales.dtype == torch.float16
    assert half.mins is None if packed.mins is None else half.mins.dtype == torch.float16
    x = torch.randn(m, 192, generator=torch.Generator().manual_seed(7))
    assert torch.equal(bind_native(half)(x), bind_native(packed)(x))
    assert kernel_packed(layer).scales is half.scales  # one copy, kept on the layer


def test_inexact_scales_stay_float32_and_copies_are_counted():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    layer = _layer(quantize_int4(w, 64))  # float32 scales from the float weight: not float16 values
    before = weight_bytes(layer)
    assert kernel_packed(layer).scales is layer.scales
    assert weight_bytes(layer) == before  # no copy made, nothing more counted
    gguf = _layer(_gguf_like("int4", 64, 128, seed=1))
    plain = weight_bytes(gguf)
    kernel_packed(gguf)
    assert weight_bytes(gguf) == plain + 2 * 2 * 64 * 4  # float16 scales and mins, [64, 4] each
