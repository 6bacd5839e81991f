"""The tile-interleaved layout of packed int4/int8 weights (``interleave_tiles`` /
``interleaved_linear`` in kernels/cpu/quant_kernels.cpp, bound by ``llmctl_kernels.quant_native``): each
tile of 4 rows stored as one run of bytes. It must give the very bits of the row layout's integer
path (same arithmetic per row, in the same order), which the torch reference bounds; and the
layout itself must put every byte where the kernel reads it (a hand-built tile). These are the
int16 passes, which run below ``set_qgemm_min_rows`` rows of x: the module moves that threshold out
of the way (from it on, the int8-digit GEMM runs: tests/kernels/test_quant_qgemm.py)."""

from __future__ import annotations

import pytest
import torch

from llmctl.layers.quantization.quantize import quantize_int4, quantize_int8
from llmctl_kernels.cpu_features import set_isa_cap
from llmctl_kernels.packed_formats import PackedInt4, PackedInt8
from llmctl_kernels.quant_linear import int_path_reference
from llmctl_kernels.quant_native import (
    InterleavedKernel,
    bind_native,
    interleaves,
    load_quant_native,
    native_unavailable_reason,
    quant_linear_native,
)

pytestmark = pytest.mark.no_device

if native_unavailable_reason() is not None:
    pytest.skip(f"quantized CPU kernels: {native_unavailable_reason()}", allow_module_level=True)

INT_PATH = False


@pytest.fixture(autouse=True)
def _int16_passes_at_every_m():
    set_rows = load_quant_native().set_qgemm_min_rows
    previous = set_rows(1 << 30)
    yield
    set_rows(previous)


def _packed(kind: str, n: int, k: int, seed: int, half: bool):
    """The packed weight the kernels read, and its float32 twin for the torch reference."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    if kind.startswith("int4"):
        packed = quantize_int4(w, int(kind[5:]))
    else:
        group = 16 if kind.startswith("int8g16") else 32  # 16: GGUF's Q6_K (mins: merged with a Q4_K part)
        sym = quantize_int8(w, group)
        mins = torch.randn(n, k // group, generator=gen) * 0.1 if kind.endswith("-mins") else None
        packed = PackedInt8(sym.qweight, sym.scales, mins, group)
    if not half:
        return packed, packed
    # GGUF-like: float16 scales and mins, as kernel_packed makes them (the twin: the same values in float32)
    cls = PackedInt4 if kind.startswith("int4") else PackedInt8
    halves = [None if t is None else t.half() for t in (packed.scales, packed.mins)]
    twin = cls(packed.qweight, *[None if t is None else t.float() for t in halves], packed.group_size)
    return cls(packed.qweight, *halves, packed.group_size), twin


@pytest.mark.parametrize("kind", ["int4g32", "int4g64", "int4g128", "int8g32", "int8-mins", "int8g16", "int8g16-mins"])
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize(
    "m", [1, 3, 5, 8, 14, 33]
)  # passes of 8 and 4 (AVX-512 pairs) or 2 (AVX2) x rows, then single rows
@pytest.mark.parametrize(("n", "k"), [(24, 256), (30, 384), (9, 1536)])  # 30, 9: a partial last tile
def test_interleaved_gives_the_row_layout_bits(kind, half, m, n, k):
    packed, twin = _packed(kind, n, k, seed=n + k + m, half=half)
    assert interleaves(packed)
    kernel = bind_native(packed)
    assert isinstance(kernel, InterleavedKernel)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    rows = quant_linear_native(x, packed, INT_PATH)  # the row layout
    out = kernel(x)
    assert torch.equal(out, rows)
    reference = int_path_reference(x, twin)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())


@pytest.mark.parametrize("kind", ["int4g32", "int8g16-mins"])
def test_the_avx2_passes_give_the_same_bits(kind):
    """``set_isa_cap("avx2")``, applied to the loaded kernels at once: the AVX2 passes of 2 x rows where
    this CPU would take the AVX-512 pairs; both must give the row layout's bits."""
    packed, _ = _packed(kind, 30, 384, seed=7, half=True)
    x = torch.randn(19, 384, generator=torch.Generator().manual_seed(1))
    best = bind_native(packed)(x)
    set_isa_cap("avx2")
    try:
        assert load_quant_native().isa() == "avx2"
        lowered = bind_native(packed)(x)
    finally:
        set_isa_cap(None)
    assert torch.equal(lowered, quant_linear_native(x, packed, INT_PATH))
    assert torch.equal(lowered, best)


def test_tile_bytes_are_where_the_kernel_reads_them():
    """One int4 tile of 4 rows, 2 groups of 32, float16 scales: [scales g0][blocks g0][scales g1]
    [blocks g1][mins g0][mins g1]."""
    n, k = 4, 64
    q = torch.arange(n * k // 2, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(n, k // 2)
    scales = torch.arange(n * 2, dtype=torch.float16).reshape(n, 2) + 1
    mins = -scales
    tiles = load_quant_native().interleave_tiles(q, scales, mins, 32)

    def halves(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8).flatten()

    expected = torch.cat(
        [halves(scales[:, 0]), q[:, :16].flatten(), halves(scales[:, 1]), q[:, 16:].flatten(), halves(mins.t())]
    )
    assert torch.equal(tiles, expected)


def test_per_channel_int8_and_the_switch_keep_the_row_layout():
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(2))
    assert not interleaves(quantize_int8(w))  # group == K: int8_linear's own per-channel path
    packed = quantize_int4(w, 32)
    assert interleaves(packed) and isinstance(bind_native(packed), InterleavedKernel)
    assert not interleaves(packed, interleave=False)
    assert not isinstance(bind_native(packed, interleave=False), InterleavedKernel)
    assert not isinstance(bind_native(packed, exact_activations=True), InterleavedKernel)  # the slab path reads rows


def test_mismatched_tiles_are_refused():
    packed, _ = _packed("int4g32", 8, 64, seed=1, half=False)
    module = load_quant_native()
    tiles = module.interleave_tiles(packed.qweight, packed.scales, packed.mins, 32)
    with pytest.raises(RuntimeError, match="tiles do not match"):
        module.interleaved_linear(torch.randn(1, 64), tiles, True, 12, 32, 4, True)
    with pytest.raises(RuntimeError, match="mins: like the scales"):
        module.interleave_tiles(packed.qweight, packed.scales, packed.mins.half(), 32)


def test_the_bound_copy_is_counted_in_weight_bytes():
    from torch import nn

    from llmctl.layers.quantization.matmul import bound_cpu_kernel
    from llmctl.layers.quantization.params import attach_packed, weight_bytes

    layer = nn.Module()
    packed, _ = _packed("int4g32", 30, 128, seed=4, half=False)
    attach_packed(layer, packed, torch.device("cpu"))
    before = weight_bytes(layer)
    kernel = bound_cpu_kernel(layer)
    assert isinstance(kernel, InterleavedKernel)
    # 8 tiles of 4 rows (2 rows of zeros), 4 groups: 4 x 4 scales + 4 x 64 nibble bytes + 4 x 4 mins, float32
    assert kernel.tiles.numel() == 8 * (4 * (16 + 64) + 4 * 16)
    assert weight_bytes(layer) == before + kernel.tiles.numel()


@pytest.mark.parametrize("kind", ["int4g32", "int8g32"])
@pytest.mark.parametrize("exact_half", [False, True])
def test_a_released_linear_layer_holds_its_bytes_once_and_computes_the_same(kind, exact_half):
    from torch import nn

    from llmctl.layers.quantization.matmul import bound_cpu_kernel
    from llmctl.layers.quantization.params import attach_packed, kernel_packed, weight_bytes

    layer = nn.Module()
    packed, _ = _packed(kind, 30, 128, seed=5, half=False)
    if exact_half:  # float32 scales that are exact float16 values (GGUF's): kernel_packed keeps float16 copies
        packed = type(packed)(
            packed.qweight,
            packed.scales.half().float(),
            None if packed.mins is None else packed.mins.half().float(),
            packed.group_size,
        )
    attach_packed(layer, packed, torch.device("cpu"))
    x = torch.randn(3, 128)
    expected = bound_cpu_kernel(layer)(x)
    kernel = bound_cpu_kernel(layer, release_rows=True)
    for name, tensor in layer.named_parameters():
        assert tensor.is_meta and tensor.shape == getattr(packed, name).shape, name
    copies = kernel_packed(layer)  # what the native decode loop binds beside the tiles: metas of the right dtype
    assert copies.scales.is_meta and copies.scales.dtype == (torch.float16 if exact_half else torch.float32)
    assert weight_bytes(layer) == kernel.tiles.numel()
    assert bound_cpu_kernel(layer) is kernel  # still bound: no rebinding from the meta tensors
    assert torch.equal(kernel(x), expected)


def test_a_layer_without_tiles_keeps_its_rows(monkeypatch):
    from torch import nn

    from llmctl.layers.quantization.matmul import bound_cpu_kernel
    from llmctl.layers.quantization.params import attach_packed

    monkeypatch.setenv("LLMCTL_QUANT_INTERLEAVE", "0")
    layer = nn.Module()
    packed, _ = _packed("int4g32", 8, 64, seed=6, half=False)
    attach_packed(layer, packed, torch.device("cpu"))
    bound_cpu_kernel(layer, release_rows=True)
    assert not layer.qweight.is_meta and torch.equal(layer.qweight, packed.qweight)
