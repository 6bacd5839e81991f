"""int8 weights whose every value is one of MXFP4's (E2M1 doubled: 0, ±1, ±2, ±3, ±4, ±6, ±8, ±12; the
MXFP4 experts repacked as int8 groups) kept in their tiles as 4-bit codes (``E2M1_TILES``,
kernels/cpu/quant_kernels.h): half the bytes of int8 tiles, and, looked up into the very int8 values,
the same products and bits as the int8 tiles in every path (the int16 passes at few rows, the
many-row GEMM) and under every ISA variant the CPU has."""

from __future__ import annotations

import pytest
import torch

from llmctl_kernels.cpu_features import set_isa_cap, supported_isa_levels
from llmctl_kernels.packed_formats import PackedInt8
from llmctl_kernels.quant_native import (
    E2M1_TILES,
    INT8_TILES,
    InterleavedKernel,
    bind_native,
    load_quant_native,
    native_unavailable_reason,
)

pytestmark = pytest.mark.no_device

if native_unavailable_reason() is not None:
    pytest.skip(f"quantized CPU kernels: {native_unavailable_reason()}", allow_module_level=True)

BOOK = [-12, -8, -6, -4, -3, -2, -1, 0, 0, 1, 2, 3, 4, 6, 8, 12]  # kE2m1Values, code by code


def _mxfp4_like(n: int, k: int, group: int, seed: int) -> PackedInt8:
    """Values drawn from the code book, power-of-two scales (as MXFP4's halved E8M0 ones)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.tensor(BOOK, dtype=torch.int8)[torch.randint(0, 16, (n, k), generator=gen)]
    scales = torch.exp2(torch.randint(-9, -3, (n, k // group), generator=gen).float())
    return PackedInt8(values, scales, None, group)


def _int8_tiles_out(packed: PackedInt8, x: torch.Tensor) -> torch.Tensor:
    module = load_quant_native()
    tiles = module.interleave_tiles(packed.qweight, packed.scales, None, packed.group_size)
    return module.interleaved_linear(x, tiles, INT8_TILES, packed.shape[0], packed.group_size, 4, False)


@pytest.fixture(params=["int16 passes", "many-row GEMM"])
def path(request):
    """The int16 passes at every M, or the many-row GEMM from 1 row on."""
    module = load_quant_native()
    previous = module.set_qgemm_min_rows(1 << 30 if request.param == "int16 passes" else 1)
    yield request.param
    module.set_qgemm_min_rows(previous)


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize(("n", "k"), [(24, 256), (30, 384), (9, 1536)])  # 30, 9: a partial last tile or panel
def test_codes_give_the_int8_tiles_bits_under_every_variant(path, group, n, k):
    packed = _mxfp4_like(n, k, group, seed=n + k + group)
    kernel = bind_native(packed)
    assert isinstance(kernel, InterleavedKernel) and kernel.kind == E2M1_TILES
    try:
        for level in supported_isa_levels():
            set_isa_cap(level)
            for m in (1, 2, 3, 5, 8, 13, 33):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
                assert torch.equal(kernel(x), _int8_tiles_out(packed, x)), (level, m)
    finally:
        set_isa_cap(None)


def test_codes_halve_the_tiles():
    packed = _mxfp4_like(32, 256, 32, seed=1)
    module = load_quant_native()
    int8_tiles = module.interleave_tiles(packed.qweight, packed.scales, None, 32)
    kernel = bind_native(packed, stepped=False)
    # per tile of 4 rows and group: 4 float32 scales, then 4 x 16 code bytes (int8: 4 x 32)
    assert kernel.tiles.numel() == 8 * 8 * (16 + 64)
    assert int8_tiles.numel() == 8 * 8 * (16 + 128)


def test_tile_bytes_hold_the_codes_where_the_kernel_reads_them():
    """One tile, one group: the 4 scales, then each row's 16 bytes, byte i = code(input i) | code(input i + 16) << 4."""
    codes = torch.arange(4 * 32).remainder(16).reshape(4, 32).flip(1)
    values = torch.tensor(BOOK, dtype=torch.int8)[codes]
    codes[codes == 8] = 7  # 0 is stored as its first code
    scales = torch.full((4, 1), 0.5)
    tiles = load_quant_native().interleave_tiles(values, scales, None, 32, e2m1=True)
    packed_codes = (codes[:, :16] | codes[:, 16:] << 4).to(torch.uint8).flatten()
    assert torch.equal(tiles, torch.cat([scales.flatten().view(torch.uint8), packed_codes]))


def test_other_int8_weights_keep_int8_tiles():
    packed = _mxfp4_like(8, 64, 32, seed=2)
    packed.qweight[3, 17] = 5  # not an E2M1 value
    module = load_quant_native()
    assert not module.e2m1_codes(packed.qweight)
    kernel = bind_native(packed)
    assert kernel.kind == INT8_TILES
    with pytest.raises(RuntimeError, match="E2M1 codes"):
        module.interleave_tiles(packed.qweight, packed.scales, None, 32, e2m1=True)
    with pytest.raises(RuntimeError, match="E2M1 codes: groups"):  # a tile of groups of 16 (Q6_K's) has no codes
        module.interleaved_linear(torch.randn(1, 64), kernel.tiles, E2M1_TILES, 8, 16, 4, False)
