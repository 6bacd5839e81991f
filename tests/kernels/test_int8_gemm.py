"""Per-channel int8 weights with per-token int16 activations (kernels/cpu/int8_gemm.h) against the
torch statement of the same arithmetic (``per_channel_int8_reference``): bit for bit, because every
dot product is an exact integer and the float steps are the same. So a row's result depends on
neither the batch (M), the tile it lands in (a full assembly tile, 6 x 4 with AVX512-VNNI or 6 x 2
with AVX2, an overlapping last tile, or an edge tile), the threads, nor the variant (VNNI, AVX2 or
the scalar one, chosen by the CPU and lowered by ``cpu_features.set_isa_cap``)."""

from __future__ import annotations

import pytest
import torch

from llmctl.layers.quantization.quantize import quantize_int8
from llmctl_kernels.cpu_features import set_isa_cap
from llmctl_kernels.packed_formats import PackedInt8
from llmctl_kernels.quant_linear import is_per_channel_int8, per_channel_int8_reference, quantize_tokens_torch
from llmctl_kernels.quant_native import native_unavailable_reason, quant_linear_native

pytestmark = pytest.mark.no_device  # CPU kernels

needs_native = pytest.mark.skipif(native_unavailable_reason() is not None, reason=str(native_unavailable_reason()))


def _case(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, PackedInt8]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10
    x[:, 3] *= 50  # an outlier channel, as LLM activations have
    return x, quantize_int8(w)


def test_reference_rounds_per_token_and_sums_exactly():
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize_tokens_torch(x)
    assert q[0].tolist() == [32767, -16384, 8192, 0]  # -16383.5 rounds half to even
    row_scale = torch.tensor(1.0) / torch.tensor(32767.0)  # float32 arithmetic, as the kernel's
    assert torch.equal(scale, torch.stack([row_scale, torch.tensor(0.0)])) and q[1].abs().sum() == 0
    packed = PackedInt8(torch.tensor([[127, -127, 1, 5]], dtype=torch.int8), torch.tensor([[0.5]]), None, 4)
    assert is_per_channel_int8(packed)
    s = 32767 * 127 + 16384 * 127 + 8192  # exact, then one rounding to float32
    expected = torch.tensor([[float(s)], [0.0]]) * (torch.stack([row_scale, torch.tensor(0.0)])[:, None] * 0.5)
    assert torch.equal(per_channel_int8_reference(x, packed), expected)


@needs_native
@pytest.mark.parametrize("m", [1, 5, 6, 7, 64, 65])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (3, 96), (30, 576), (17, 1536), (5, 8224)])  # 8224 > 2 x KC
def test_kernel_equals_reference_bitwise(m, n, k):
    x, packed = _case(m, n, k, seed=m * 1000 + n + k)
    assert torch.equal(quant_linear_native(x, packed), per_channel_int8_reference(x, packed))


@needs_native
def test_rows_do_not_depend_on_the_batch():
    x, packed = _case(64, 96, 576, seed=3)
    together = quant_linear_native(x, packed)
    for i in (0, 5, 6, 59, 63):  # full 6-row tiles and the last 4 rows (an overlapping tile)
        assert torch.equal(quant_linear_native(x[i : i + 1], packed)[0], together[i])
        assert torch.equal(quant_linear_native(x[i : i + 7], packed)[0], together[i])


@needs_native
def test_float16_scales_read_as_the_same_float32():
    x, packed = _case(9, 20, 128, seed=4)
    exact = PackedInt8(packed.qweight, packed.scales.half().float(), None, 128)  # scales exact in float16
    half = PackedInt8(packed.qweight, exact.scales.half(), None, 128)
    assert torch.equal(quant_linear_native(x, half), quant_linear_native(x, exact))


@needs_native
def test_extremes_do_not_overflow():
    """|w| = 128 and |x| = 32767 everywhere (8 rows x 3 and x 5: full, overlapping and edge tiles of
    both variants): two int32 lanes together stay below 2^31 up to 2048 inputs, longer rows are
    flushed to int64 every 2048; the result is the exact -128 * 32767 * K, rounded once."""
    for k, n in ((2048, 3), (4096 + 32, 5), (8192 + 64, 3)):
        packed = PackedInt8(torch.full((n, k), -128, dtype=torch.int8), torch.ones(n, 1), None, k)
        x = torch.ones(8, k)
        x[1] = 0.0  # an all-zero row: scale 0, output 0
        got = quant_linear_native(x, packed)
        assert torch.equal(got, per_channel_int8_reference(x, packed))
        assert torch.all(got[1] == 0)
        assert got[0, 0].double().item() == pytest.approx(-128.0 * k, rel=1e-6)


@needs_native
def test_half_precision_activations_round_once():
    x, packed = _case(4, 24, 256, seed=5)
    for dtype in (torch.bfloat16, torch.float16):
        xh = x.to(dtype)
        got = quant_linear_native(xh, packed)
        assert got.dtype == dtype
        assert torch.equal(got, per_channel_int8_reference(xh.float(), packed).to(dtype))


LOWER_VARIANT_CASES = [(13, 30, 1536, 11), (64, 96, 576, 3), (7, 9, 2048, 8), (5, 4, 4096 + 32, 9)]


def _lower_variant_inputs(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, PackedInt8]:
    """_case, and for seed 8 the extremes at K = KC (the AVX2 tile's direct-to-output path takes
    rows up to KC long: its int32 lane pairs are exact right up to there)."""
    if seed != 8:
        return _case(m, n, k, seed)
    return torch.ones(m, k), PackedInt8(torch.full((n, k), -128, dtype=torch.int8), torch.ones(n, 1), None, k)


@needs_native
@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_lower_variants_compute_the_same_integers(isa):
    """``set_isa_cap("generic")``: the scalar variant; ``"avx2"``: the AVX2 tile where this CPU would
    take the AVX512-VNNI one (the cap applies to the loaded kernels at once): full tiles written
    straight to the output (K <= KC), overlapping and edge tiles, rows longer than KC."""
    best = [quant_linear_native(*_lower_variant_inputs(*case)) for case in LOWER_VARIANT_CASES]
    set_isa_cap(isa)
    try:
        lowered = [quant_linear_native(*_lower_variant_inputs(*case)) for case in LOWER_VARIANT_CASES]
    finally:
        set_isa_cap(None)
    for case, lower, top in zip(LOWER_VARIANT_CASES, lowered, best, strict=True):
        x, packed = _lower_variant_inputs(*case)
        assert torch.equal(lower, per_channel_int8_reference(x, packed)), case
        assert torch.equal(lower, top), case


def test_cpu_fallback_without_native_kernels_computes_the_same_integers(monkeypatch):
    """A CPU where the native kernels are not available (no AVX2, no compiler, switched off) runs
    the torch statement of the same arithmetic: the same bits as the kernel."""
    from llmctl.layers.quantization.matmul import quant_linear

    x, packed = _case(5, 24, 192, seed=12)
    monkeypatch.setenv("LLMCTL_NATIVE_CPU_KERNELS", "0")  # llmctl/platform.py then loads none
    fallback = quant_linear(x, packed)
    monkeypatch.delenv("LLMCTL_NATIVE_CPU_KERNELS")
    assert torch.equal(fallback, per_channel_int8_reference(x, packed))
    if native_unavailable_reason() is None:
        assert torch.equal(fallback, quant_linear_native(x, packed))
