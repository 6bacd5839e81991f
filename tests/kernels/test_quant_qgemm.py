"""The int8-activation GEMM of packed int4/int8 weights at many rows (kernels/cpu/qgemm.h), which
``interleaved_gemm`` takes from ``set_qgemm_min_rows`` rows of x on (a default per CPU and weight kind):
every ISA variant (VNNI, AVX2, the scalar reference) gives the same bits; no row depends on the
others in its batch; against its torch statement it differs by float32 summation only, and
against the float32 dequantized matmul by at most the int8 rounding of the activations."""

from __future__ import annotations

import pytest
import torch

from llmctl.layers.quantization.quantize import quantize_int4, quantize_int8
from llmctl_kernels.cpu_features import cpu_flags, set_isa_cap, supported_isa_levels
from llmctl_kernels.packed_formats import PackedInt4, PackedInt8, dequantize
from llmctl_kernels.quant_linear import (
    ACTIVATION_BLOCK,
    INT8_ACTIVATION_LEVELS,
    int8_activation_reference,
    int_path_reference,
)
from llmctl_kernels.quant_native import InterleavedKernel, bind_native, load_quant_native, native_unavailable_reason

pytestmark = pytest.mark.no_device

if native_unavailable_reason() is not None:
    pytest.skip(f"quantized CPU kernels: {native_unavailable_reason()}", allow_module_level=True)

MIN_ROWS = 8  # the threshold these tests fix (the default, 0, picks one per CPU and weight kind)
KINDS = ["int4g32", "int4g64", "int4g128", "int8g32", "int8-mins", "int8g16", "int8g16-mins"]


def _packed(kind: str, n: int, k: int, seed: int, half: bool):
    """The packed weight the kernel reads and its float32 twin (the same values) for the references."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    if kind.startswith("int4"):
        packed = quantize_int4(w, int(kind[5:]))
    else:
        group = 16 if kind.startswith("int8g16") else 32  # 16: GGUF's Q6_K, each block's halves scaled apart
        sym = quantize_int8(w, group)
        mins = torch.randn(n, k // group, generator=gen) * 0.1 if kind.endswith("-mins") else None
        packed = PackedInt8(sym.qweight, sym.scales, mins, group)
    if not half:
        return packed, packed
    cls = PackedInt4 if kind.startswith("int4") else PackedInt8
    halves = [None if t is None else t.half() for t in (packed.scales, packed.mins)]
    twin = cls(packed.qweight, *[None if t is None else t.float() for t in halves], packed.group_size)
    return cls(packed.qweight, *halves, packed.group_size), twin


@pytest.fixture
def min_rows():
    """Moves the row count from which the int8 path runs; restored after the test."""
    module = load_quant_native()
    previous = module.set_qgemm_min_rows(MIN_ROWS)
    assert previous == 0, "a test left the threshold moved"
    yield module.set_qgemm_min_rows
    module.set_qgemm_min_rows(previous)


def _under_each_isa(kernel, x) -> dict[str, torch.Tensor]:
    outs = {}
    try:
        for level in [*supported_isa_levels()]:
            set_isa_cap(level)
            outs[level] = kernel(x)
    finally:
        set_isa_cap(None)
    return outs


def _int8_rounding_bound(x: torch.Tensor, packed) -> torch.Tensor:
    """|kernel - x @ W^T| <= sum_k |q part of w[n, k]| * scale_x(block of k) / 2 (plus float noise)."""
    m, k = x.shape
    scale = x.abs().reshape(m, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK).amax(-1) / INT8_ACTIVATION_LEVELS
    per_input = scale.repeat_interleave(ACTIVATION_BLOCK, dim=1) / 2
    mins = 0 if packed.mins is None else packed.mins.float().repeat_interleave(packed.group_size, 1)
    return per_input @ (dequantize(packed) - mins).abs().t()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("m", [8, 13, 64])
@pytest.mark.parametrize(("n", "k"), [(64, 256), (76, 384), (9, 1536)])  # 76, 9: partial panels and tiles
def test_every_isa_variant_gives_the_same_bits_and_the_reference(kind, half, m, n, k, min_rows):
    packed, twin = _packed(kind, n, k, seed=n + k + m, half=half)
    kernel = bind_native(packed)
    assert isinstance(kernel, InterleavedKernel)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    outs = _under_each_isa(kernel, x)
    best = outs[supported_isa_levels()[0]]
    for level, out in outs.items():
        assert torch.equal(out, best), level  # the scalar variant ("generic") included
    reference = int8_activation_reference(x, twin)
    scale = reference.abs().max().item()
    torch.testing.assert_close(best, reference, rtol=1e-5, atol=1e-5 * scale)
    exact = x @ dequantize(twin).t()
    assert ((best - exact).abs() <= _int8_rounding_bound(x, twin) + 1e-5 * scale).all()


@pytest.mark.parametrize("kind", ["int4g32", "int8g32", "int8-mins", "int8g16"])
def test_rows_do_not_depend_on_the_batch(kind, min_rows):
    """Each row's bits are the same among 8, 13 or 100 rows, and alone when the path runs from 1 row."""
    packed, _ = _packed(kind, 80, 256, seed=3, half=True)
    kernel = bind_native(packed)
    x = torch.randn(100, 256, generator=torch.Generator().manual_seed(4))
    together = kernel(x)
    for rows in (slice(0, 8), slice(87, 100), slice(40, 53)):
        assert torch.equal(kernel(x[rows]), together[rows])
    min_rows(1)
    for i in (0, 57, 99):
        assert torch.equal(kernel(x[i : i + 1])[0], together[i])


def test_the_path_changes_at_the_threshold_only(min_rows):
    """Below the threshold the int16 passes (the row layout's bits), from it on the int8 GEMM."""
    packed, twin = _packed("int4g32", 48, 256, seed=5, half=True)
    kernel = bind_native(packed)
    x = torch.randn(MIN_ROWS, 256, generator=torch.Generator().manual_seed(6))
    few = kernel(x[: MIN_ROWS - 1])
    torch.testing.assert_close(few, int_path_reference(x[: MIN_ROWS - 1], twin), rtol=1e-5, atol=1e-4)
    many = kernel(x)
    torch.testing.assert_close(many, int8_activation_reference(x, twin), rtol=1e-5, atol=1e-4)
    assert not torch.equal(many[: MIN_ROWS - 1], few)  # int8 rounding, not int16
    min_rows(1 << 30)
    assert torch.equal(kernel(x)[: MIN_ROWS - 1], few)
    with pytest.raises(RuntimeError, match="at least 1"):
        min_rows(-1)


def _default_threshold(level: str, int4: bool) -> int:
    """quant_kernels.cpp's qgemm_min_rows: with AVX512-VNNI 2 for int4 weights and 3 for int8; in
    the AVX2 variant (a CPU, or a cap, without it) 3 for int4 and 8 for int8; 8 for the scalar code."""
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= cpu_flags() and level.startswith("avx512")
    if vnni:
        return 2 if int4 else 3
    return 3 if int4 and level != "generic" else 8


@pytest.mark.parametrize("kind", ["int4g32", "int8g32"])
def test_the_default_threshold_is_the_measured_one_for_each_variant(kind, min_rows):
    """With the threshold left to the kernels, each variant switches to the int8 GEMM at exactly the
    row count chosen for it and the weight kind (the int8 GEMM's rows do not depend on M, so a row
    among 16 shows which path ran)."""
    packed, _ = _packed(kind, 48, 256, seed=7, half=True)
    kernel = bind_native(packed)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(8))
    for level in supported_isa_levels():
        set_isa_cap(level)
        try:
            min_rows(1)
            int8_rows = kernel(x)
            min_rows(0)
            switch = next(m for m in range(1, 17) if torch.equal(kernel(x[:m]), int8_rows[:m]))
        finally:
            set_isa_cap(None)
            min_rows(MIN_ROWS)
        assert switch == _default_threshold(level, kind.startswith("int4")), level


def test_extreme_codes_and_zero_blocks(min_rows):
    """int8 weights of -128 and 127 (VNNI's unsigned x + 128 trick, AVX2's sign extension), int4 codes of
    0 and 15, and all-zero activation blocks (scale 0) stay exact in every variant."""
    k, m = 64, 8
    q = torch.full((16, k), -128, dtype=torch.int8)
    q[8:] = 127
    x = torch.zeros(m, k)
    x[1:, 32:] = torch.linspace(-1, 1, 32)
    x[3] = -x[3]
    int8 = PackedInt8(q, torch.ones(16, 2), None, 32)
    nibbles = torch.full((16, k // 2), 0xF0, dtype=torch.uint8)
    int4 = PackedInt4(nibbles, torch.ones(16, 2), torch.full((16, 2), -7.5), 32)
    for packed in (int8, int4):
        outs = _under_each_isa(bind_native(packed), x)
        for out in outs.values():
            torch.testing.assert_close(out, int8_activation_reference(x, packed), rtol=1e-6, atol=1e-5)
        assert torch.all(next(iter(outs.values()))[0] == 0)
