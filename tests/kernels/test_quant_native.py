"""The native quantized linear kernels against their torch references, on every ISA path this CPU has.

Tolerances: the slab (prefill) path and the fp8 kernel compute exactly the reference's products in
float32, so they differ only by summation order (~1e-5 of the output scale). The integer path
rounds the activations to int16 per 32-input block (per token for per-channel int8);
against ``int_path_reference`` (the same rounding in torch) it again differs only by summation order,
and against the plain reference by at most the rounding bound sum_k |w[n, k]| * scale_x(block of k) / 2,
which the test computes and checks.
"""

from __future__ import annotations

import pytest
import torch

from llmctl.layers.quantization.quantize import quantize_fp8, quantize_int4, quantize_int8
from llmctl_kernels.packed_formats import PackedInt4, PackedInt8, dequantize
from llmctl_kernels.quant_linear import (
    ACTIVATION_BLOCK,
    ACTIVATION_LEVELS,
    int_path_reference,
    is_per_channel_int8,
    quant_linear_torch,
)
from llmctl_kernels.quant_native import bind_native, native_unavailable_reason, quant_linear_native

pytestmark = pytest.mark.no_device  # CPU kernels: run whatever the Triton test device is

if native_unavailable_reason() is not None:
    pytest.skip(f"quantized CPU kernels: {native_unavailable_reason()}", allow_module_level=True)

INT_PATH, SLAB_PATH = False, True


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)  # rows of different scale


def _packed(kind: str, w: torch.Tensor):
    n, k = w.shape
    if kind.startswith("int4"):
        return quantize_int4(w, int(kind[5:]))
    if kind == "int8":
        return quantize_int8(w)
    if kind.startswith("int8g"):
        return quantize_int8(w, int(kind[5:]))
    if kind == "int8-mins":  # an asymmetric int8 layout (what GGUF's Q5_K becomes)
        sym = quantize_int8(w, 32)
        return PackedInt8(
            sym.qweight, sym.scales, torch.randn(n, k // 32, generator=torch.Generator().manual_seed(1)) * 0.1, 32
        )
    return quantize_fp8(w)


KINDS = ["int4g32", "int4g64", "int4g128", "int8", "int8g32", "int8g16", "int8-mins", "fp8"]


def _rounding_bound(x: torch.Tensor, packed) -> torch.Tensor:
    m, k = x.shape
    block = k if is_per_channel_int8(packed) else ACTIVATION_BLOCK  # per-channel int8 rounds per token
    scale = x.abs().reshape(m, k // block, block).amax(-1) / ACTIVATION_LEVELS
    per_input = scale.repeat_interleave(block, dim=1) / 2  # max |x - x_rounded|
    q_part = dequantize(packed) - (0 if packed.mins is None else packed.mins.repeat_interleave(packed.group_size, 1))
    return per_input @ q_part.abs().t()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 3, 4, 7, 33])
@pytest.mark.parametrize(("n", "k"), [(24, 128), (40, 384), (30, 256)])  # 30: a tile of 2 rows at the end
def test_integer_and_direct_paths_match_reference(kind, m, n, k):
    w = _weights(n, k, seed=n + k)
    packed = _packed(kind, w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = quant_linear_native(x, packed, INT_PATH)
    expected = quant_linear_torch(x, packed)
    assert got.shape == (m, n) and got.dtype == torch.float32
    scale = expected.abs().max().item()
    if kind == "fp8":  # no activation rounding: fp32 products, another summation order
        torch.testing.assert_close(got, expected, atol=2e-5 * scale, rtol=1e-5)
        return
    torch.testing.assert_close(got, int_path_reference(x, packed), atol=2e-5 * scale, rtol=1e-5)
    assert ((got - expected).abs() <= _rounding_bound(x, packed) + 2e-5 * scale).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 5, 70])
def test_slab_path_matches_reference(kind, m):
    n, k = 300, 256  # more rows than one slab (256)
    packed = _packed(kind, _weights(n, k, seed=3))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    expected = quant_linear_torch(x, packed)
    torch.testing.assert_close(
        quant_linear_native(x, packed, SLAB_PATH), expected, atol=2e-5 * expected.abs().max().item(), rtol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["int4g64", "int8", "fp8"])
def test_half_precision_activations(kind, dtype):
    """bf16/fp16 x is read as float32 and the float32 result rounded once to x's dtype."""
    packed = _packed(kind, _weights(48, 256, seed=5))
    x = torch.randn(2, 256).to(dtype)
    got = quant_linear_native(x, packed)
    reference = int_path_reference if kind != "fp8" else quant_linear_torch
    expected = reference(x.float(), packed).to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", ["int4g64", "int8"])
def test_integer_rows_do_not_depend_on_the_batch(kind):
    """Each row's result is bitwise the same alone or among 100 rows (batched == unbatched)."""
    packed = _packed(kind, _weights(32, 128, seed=7))
    x = torch.randn(100, 128)
    together = quant_linear_native(x, packed)
    assert torch.equal(together, quant_linear_native(x, packed, INT_PATH))
    for i in (0, 5, 99):
        assert torch.equal(quant_linear_native(x[i : i + 1], packed)[0], together[i])


def test_fp8_picks_direct_path_for_decode_and_slabs_for_prefill():
    packed = _packed("fp8", _weights(32, 128, seed=7))
    x = torch.randn(100, 128)
    assert torch.equal(quant_linear_native(x[:2], packed), quant_linear_native(x[:2], packed, INT_PATH))
    assert torch.equal(quant_linear_native(x, packed), quant_linear_native(x, packed, SLAB_PATH))


def test_zero_and_extreme_rows():
    """All-zero activation blocks (scale 0) and int8 weights of -128 (|w| = 128 as u8) stay exact."""
    k = 64
    q = torch.full((2, k), -128, dtype=torch.int8)
    q[1] = 127
    packed = PackedInt8(q, torch.ones(2, 1), None, k)
    x = torch.zeros(2, k)
    x[1, 32:] = torch.linspace(-1, 1, 32)
    got = quant_linear_native(x, packed, INT_PATH)
    torch.testing.assert_close(got, int_path_reference(x, packed), atol=1e-4, rtol=1e-5)
    assert torch.all(got[0] == 0)


def test_int4_rejects_odd_groups():
    packed = quantize_int4(_weights(8, 64, seed=1), 32)
    bad = PackedInt4(packed.qweight, torch.ones(8, 4), torch.zeros(8, 4), 16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quant_linear_native(torch.randn(1, 64), bad)


def test_bound_kernel_computes_what_the_per_call_path_does():
    """``bind_native`` (what a layer keeps) fixes the path when bound (1 row of x: below every
    default threshold of the many-row GEMM, whose int8 activations the per-call path does not use)."""
    packed = _packed("int4g32", _weights(40, 128, seed=9))
    x = torch.randn(1, 128)
    assert torch.equal(bind_native(packed)(x), quant_linear_native(x, packed, INT_PATH))
    assert torch.equal(bind_native(packed, exact_activations=True)(x), quant_linear_native(x, packed, SLAB_PATH))
    fp8 = _packed("fp8", _weights(40, 128, seed=9))
    assert torch.equal(bind_native(fp8)(x), quant_linear_native(x, fp8))


def test_layer_rebinds_when_its_packed_weight_changes():
    from llmctl.layers.linear import ColumnParallelLinear
    from llmctl.layers.quantization import install_packed_weight

    layer = ColumnParallelLinear(128, 40, dtype=torch.float32)
    x = torch.randn(1, 128)  # below every default threshold of the many-row GEMM
    for seed in (1, 2):
        packed = _packed("int4g64", _weights(40, 128, seed=seed))
        install_packed_weight(layer, packed)
        assert torch.equal(layer(x), quant_linear_native(x, packed))
