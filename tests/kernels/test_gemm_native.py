"""The native fp32 panel GEMM (kernels/cpu/gemm_kernels.cpp) against its torch reference
(kernels/fp32_linear.py), in every ISA variant this CPU runs, and its batch invariance: a row's
result is bitwise the same whatever the number of rows, the thread count or the ISA variant."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from llmctl_kernels.cpu_features import isa_level, supported_isa_levels
from llmctl_kernels.fp32_linear import fp32_linear_torch, pack_panels, unpack_panels
from llmctl_kernels.gemm_native import fp32_linear_native, load_gemm_native, native_unavailable_reason

if native_unavailable_reason() is not None and not shutil.which("g++"):
    pytest.skip(f"native fp32 GEMM: {native_unavailable_reason()}", allow_module_level=True)

# The module's variants; an AVX512-BF16 CPU runs the AVX-512 one.
ISAS = [level for level in supported_isa_levels() if level != "avx512bf16"]
# Row counts around every tile size (AVX2 6 rows, AVX-512 8, generic 4) and the 144-row block.
ROW_COUNTS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 64, 65, 150, 300]
# Shapes (N, K) with ragged panels (N % 16), a single panel, and K across the 256-wide K blocks.
SHAPES = [(1, 1), (15, 7), (16, 64), (17, 33), (100, 300), (250, 600), (1000, 576)]


def test_builds_where_a_compiler_exists():
    module = load_gemm_native()
    assert module is not None, native_unavailable_reason()
    assert set(ISAS) <= set(module.compiled_isas())


@pytest.fixture(params=ISAS)
def isa(request):
    """Runs the test once per kernel variant this CPU can execute, then restores the best one."""
    module = load_gemm_native()
    module.set_isa(request.param)
    yield request.param
    module.set_isa(isa_level())


def _case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen))


def test_pack_and_unpack_are_inverse():
    w = torch.randn(37, 11)
    packed = pack_panels(w)
    assert packed.shape == (3, 11, 16) and packed.is_contiguous()
    assert torch.equal(packed[2, :, 5:], torch.zeros(11, 11))  # the padding columns
    assert torch.equal(packed[1, 4, 3], w[19, 4])
    assert torch.equal(unpack_panels(packed, 37), w)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_torch_reference(isa, n, k, bias):
    for m in (1, 5, 13, 150):
        x, w, b = _case(m, n, k, seed=m)
        packed = pack_panels(w)
        got = fp32_linear_native(x, packed, n, b if bias else None)
        expected = fp32_linear_torch(x, packed, n, b if bias else None)
        exact = F.linear(x.double(), w.double(), b.double() if bias else None)
        # fp32 sums of k terms: the error of either order grows like sqrt(k) * eps * |terms|
        scale = (x.abs().double() @ w.abs().double().t()).max().item()
        assert (got.double() - exact).abs().max().item() <= 4e-7 * scale * k**0.5 + 1e-6
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale**0.5)


@pytest.mark.parametrize(("n", "k"), [(17, 33), (100, 300), (250, 600)])
def test_a_row_does_not_depend_on_its_batch(isa, n, k):
    """Row i of an M-row product equals the 1-row product of row i, bitwise, for M across every
    tile and tail size (the engine's batched == unbatched promise)."""
    x, w, b = _case(max(ROW_COUNTS), n, k)
    packed = pack_panels(w)
    alone = torch.cat([fp32_linear_native(x[i : i + 1], packed, n, b) for i in range(x.shape[0])])
    for m in ROW_COUNTS:
        assert torch.equal(fp32_linear_native(x[:m], packed, n, b), alone[:m]), f"M={m}"
    shuffled = torch.randperm(x.shape[0])  # and wherever the row sits in its tile
    assert torch.equal(fp32_linear_native(x[shuffled], packed, n, b), alone[shuffled])


def test_threads_do_not_change_a_result():
    x, w, _ = _case(70, 1000, 576)
    packed = pack_panels(w)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(fp32_linear_native(x, packed, 1000))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.skipif(len(ISAS) < 2, reason="one kernel variant on this CPU")
def test_every_isa_variant_gives_the_same_bits():
    """Each output is the same chain of exactly rounded FMAs in every variant, the scalar one too."""
    module = load_gemm_native()
    x, w, b = _case(29, 250, 600)
    packed = pack_panels(w)
    try:
        results = {}
        for level in ISAS:
            module.set_isa(level)
            results[level] = fp32_linear_native(x, packed, 250, b)
    finally:
        module.set_isa(isa_level())
    assert all(torch.equal(results["generic"], r) for r in results.values()), list(results)


def test_any_leading_shape_and_strided_input():
    x, w, _ = _case(12, 40, 64)
    packed = pack_panels(w)
    y = fp32_linear_native(x.view(3, 4, 64), packed, 40)
    assert y.shape == (3, 4, 40)
    assert torch.equal(y.view(12, 40), fp32_linear_native(x, packed, 40))
    wide = torch.randn(12, 128)
    assert torch.equal(
        fp32_linear_native(wide[:, ::2], packed, 40), fp32_linear_native(wide[:, ::2].contiguous(), packed, 40)
    )
    assert fp32_linear_native(x[:0], packed, 40).shape == (0, 40)


def test_large_outputs_reuse_freed_buffers_and_stay_correct():
    """Outputs of 2 MiB and more come from a cache of freed output buffers (no page faults per
    layer in a prefill step): a live output is never handed out twice, a freed one is reused, and
    every result is still the exact product."""
    x, w, _ = _case(520, 1040, 64)  # 520 x 1040 fp32 = 2.06 MiB
    packed = pack_panels(w)
    reference = F.linear(x, w)
    first = fp32_linear_native(x, packed, 1040)
    second = fp32_linear_native(x * 2, packed, 1040)  # both alive: two distinct buffers
    assert first.data_ptr() != second.data_ptr()
    freed = second.data_ptr()
    del second
    third = fp32_linear_native(x, packed, 1040)
    assert third.data_ptr() == freed  # taken from the cache
    assert torch.equal(third, first)
    torch.testing.assert_close(third, reference, rtol=1e-5, atol=1e-4)
    view = third[::3]  # a view keeps the buffer alive
    del third
    assert fp32_linear_native(x, packed, 1040).data_ptr() != view.data_ptr()
    assert torch.equal(view, first[::3])


def test_bad_arguments_are_one_line_errors():
    x, w, _ = _case(2, 40, 64)
    packed = pack_panels(w)
    with pytest.raises(RuntimeError, match="input has 32 features, the weight 64"):
        fp32_linear_native(x[:, :32], packed, 40)
    with pytest.raises(RuntimeError, match="50 columns do not fit 3 panels"):
        fp32_linear_native(x, packed, 50)
    with pytest.raises(RuntimeError, match=r"packed as \[panels, K, 16\]"):
        fp32_linear_native(x, w, 40)
    with pytest.raises(RuntimeError, match="float32 only"):
        fp32_linear_native(x.double(), packed, 40)


def test_linear_layers_take_it_and_can_turn_it_off(monkeypatch):
    """fp32 linear layers pack their weight at load where the native GEMM is wanted (the rule in
    llmctl/platform.py), ``LLMCTL_NATIVE_GEMM=0`` keeps torch's GEMM."""
    from llmctl.layers.linear import MergedColumnParallelLinear
    from llmctl.platform import native_gemm_wanted

    def build() -> MergedColumnParallelLinear:
        layer = MergedColumnParallelLinear(64, [40, 40], dtype=torch.float32)
        gen = torch.Generator().manual_seed(3)
        for shard in (0, 1):
            layer.weight_loader(layer.weight, torch.randn(40, 64, generator=gen), shard)
        return layer

    x = torch.randn(5, 64)
    plain = build()
    expected = F.linear(x, plain.weight)
    monkeypatch.setenv("LLMCTL_NATIVE_GEMM", "1")
    assert native_gemm_wanted()
    packed = build()
    packed.process_weights_after_loading()
    assert packed.weight.shape == (5, 64, 16)
    assert torch.equal(packed(x), fp32_linear_native(x, packed.weight, 80))
    torch.testing.assert_close(packed(x), expected)
    monkeypatch.setenv("LLMCTL_NATIVE_GEMM", "0")
    off = build()
    off.process_weights_after_loading()
    assert off.weight.dim() == 2  # small enough to stay plain for oneDNN too
    assert torch.equal(off(x), expected)
    monkeypatch.setenv("LLMCTL_NATIVE_GEMM", "yes")
    with pytest.raises(ValueError, match="LLMCTL_NATIVE_GEMM='yes'"):
        native_gemm_wanted()
