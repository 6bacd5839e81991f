"""Stepped scales in the tile-interleaved layout (kernels/cpu/quant_kernels.cpp): scales and mins
that are an int8 per group times a float32 step per 256 inputs and row (GGUF's K-quants store
``d * sc``, ``d`` float16, ``sc`` of 6 or 8 bits) are kept so, a byte a group instead of four. The
kernels multiply back the very float32 values, so every path (the int16 passes, the int8-digit
GEMM on every ISA variant) gives the bits of the float32 tiles and of the row layout."""

from __future__ import annotations

import pytest
import torch

from llmctl_kernels.cpu_features import set_isa_cap, supported_isa_levels
from llmctl_kernels.packed_formats import PackedInt4, PackedInt8
from llmctl_kernels.quant_linear import int_path_reference
from llmctl_kernels.quant_native import (
    InterleavedKernel,
    bind_native,
    load_quant_native,
    native_unavailable_reason,
    quant_linear_native,
)

pytestmark = pytest.mark.no_device

if native_unavailable_reason() is not None:
    pytest.skip(f"quantized CPU kernels: {native_unavailable_reason()}", allow_module_level=True)

STEP = 256


def _k_quant_values(n: int, k: int, group: int, ints: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """[n, k / group] float32 values d * sc: d a float16 (either sign) per 256 inputs and row, sc in ``ints``."""
    d = (torch.randn(n, k // STEP, 1, generator=gen) * 1e-2).half().float()
    sc = torch.randint(ints[0], ints[1] + 1, (n, k // STEP, STEP // group), generator=gen).float()
    return (d * sc).reshape(n, k // group)


def _k_quant(kind: str, n: int, k: int, seed: int):
    """Q4_K-like (int4, group 32, ``d sc`` and ``-dmin m`` with 6-bit sc, m) or Q6_K-like (int8,
    group 16, ``d sc`` with sc in -128..127) packed weights, their scales in float32."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "q4k":
        qweight = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        scales = _k_quant_values(n, k, 32, (0, 63), gen).abs()
        mins = -_k_quant_values(n, k, 32, (0, 63), gen).abs()
        return PackedInt4(qweight, scales, mins, 32)
    qweight = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
    group = 16 if kind == "q6k" else 32
    mins = -_k_quant_values(n, k, group, (0, 63), gen).abs() if kind == "q5k" else None
    return PackedInt8(qweight, _k_quant_values(n, k, group, (-128, 127), gen), mins, group)


def test_step_scales_factor_exactly_or_refuse():
    module = load_quant_native()
    gen = torch.Generator().manual_seed(0)
    values = _k_quant_values(6, 512, 16, (-128, 127), gen)
    values[0, :16] = 0  # a step of zeros
    values[1, :16] = torch.randint(0, 128, (16,), generator=gen).float() * 2.0**-7
    values[1, :2] = torch.tensor([128.0, 1.0]) * 2.0**-7  # +128 times the step: the step takes the other sign
    ints, steps = module.step_scales(values, 16)
    assert ints.dtype == torch.int8 and steps.dtype == torch.float32 and steps.shape == (6, 2)
    assert torch.equal(ints.float() * steps.repeat_interleave(16, dim=1), values)
    assert steps[0, 0] == 0 and ints[1, 0] == -128
    assert module.step_scales(torch.rand(4, 16), 16) is None  # arbitrary float32 scales
    assert module.step_scales(torch.tensor([[1.0, 200.0] * 4]), 32) is None  # ints 1 and 200: past int8
    assert module.step_scales(torch.rand(2, 4), 32) is None  # K of 128: no whole step


@pytest.mark.parametrize("kind", ["q4k", "q6k", "q5k"])
@pytest.mark.parametrize("m", [1, 3, 8, 33])
@pytest.mark.parametrize(("n", "k"), [(24, 256), (30, 768)])
def test_stepped_tiles_give_the_row_layout_bits(kind, m, n, k):
    module = load_quant_native()
    previous = module.set_qgemm_min_rows(1 << 30)  # the int16 passes at every M
    try:
        packed = _k_quant(kind, n, k, seed=n + k + m)
        kernel = bind_native(packed)
        plain = bind_native(packed, stepped=False)
        assert isinstance(kernel, InterleavedKernel) and kernel.scale_bytes == 1 and plain.scale_bytes == 4
        assert kernel.tiles.numel() < plain.tiles.numel()
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        out = kernel(x)
        assert torch.equal(out, plain(x))
        assert torch.equal(out, quant_linear_native(x, packed, False))  # the row layout
        reference = int_path_reference(x, packed)
        torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())
    finally:
        module.set_qgemm_min_rows(previous)


@pytest.mark.parametrize("kind", ["q4k", "q5k", "q6k"])
@pytest.mark.parametrize("m", [8, 13, 64])
def test_stepped_tiles_in_the_int8_digit_gemm_on_every_isa(kind, m):
    """From 8 rows: every ISA variant, the scalar one included, reads the stepped tiles to the
    float32 tiles' bits."""
    packed = _k_quant(kind, 76, 512, seed=m)
    kernel, plain = bind_native(packed), bind_native(packed, stepped=False)
    assert kernel.scale_bytes == 1
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)) * 3
    try:
        for level in supported_isa_levels():
            set_isa_cap(level)
            assert torch.equal(kernel(x), plain(x)), level
    finally:
        set_isa_cap(None)


def test_the_avx2_passes_read_stepped_tiles_alike():
    """The int16 passes (the many-row GEMM kept off: its threshold differs by variant) give the
    same bits in every variant."""
    packed = _k_quant("q6k", 30, 512, seed=5)
    kernel = bind_native(packed)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    module = load_quant_native()
    previous = module.set_qgemm_min_rows(1 << 30)
    try:
        best = kernel(x)
        set_isa_cap("avx2")
        assert torch.equal(kernel(x), best)
    finally:
        set_isa_cap(None)
        module.set_qgemm_min_rows(previous)


def test_stepped_tile_bytes_are_where_the_kernel_reads_them():
    """One int4 tile of 4 rows, K = 256 (8 groups of 32, one step): the 4 rows' scale steps and min
    steps (float32), [sc g][nibbles g] for each group, then the mins' ints by group."""
    packed = _k_quant("q4k", 4, 256, seed=1)
    module = load_quant_native()
    ints, steps = module.step_scales(packed.scales, 32)
    min_ints, min_steps = module.step_scales(packed.mins, 32)
    tiles = module.interleave_tiles(packed.qweight, ints, min_ints, 32, steps, min_steps)

    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8).flatten()

    groups = [torch.cat([as_bytes(ints[:, g]), packed.qweight[:, 16 * g : 16 * g + 16].flatten()]) for g in range(8)]
    expected = torch.cat([as_bytes(steps.t()), as_bytes(min_steps.t()), *groups, as_bytes(min_ints.t())])
    assert torch.equal(tiles, expected)
    assert tiles.numel() * 8 / (4 * 256) == 4.75  # bits a weight (float32 scales and mins: 6)


def test_steps_must_come_with_int8_scales():
    packed = _k_quant("q4k", 4, 256, seed=2)
    module = load_quant_native()
    ints, steps = module.step_scales(packed.scales, 32)
    with pytest.raises(RuntimeError, match="steps"):
        module.interleave_tiles(packed.qweight, ints, None, 32)
    with pytest.raises(RuntimeError, match="steps"):
        module.interleave_tiles(packed.qweight, packed.scales, None, 32, steps)
