"""The on-the-fly quantizers' scale searches (int4 scale and min, fp8 per-channel scale): same packed
formats as plain round-to-nearest, never a larger error than it, deterministic."""

from __future__ import annotations

import pytest
import torch

from llmctl.layers.quantization import dequantize, quantize_fp8, quantize_int4
from llmctl_kernels.packed_formats import unpack_int4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


KINDS = ["normal", "heavy_tailed", "outlier_column", "off_centre", "grid", "degenerate"]


def _weights(kind: str, n: int = 48, k: int = 256) -> torch.Tensor:
    """Random and structured weights: bell-shaped, heavy-tailed, one outlier column, off-centre,
    a coarse grid (a dequantized 4-bit file), all-zero and constant rows."""
    g = _gen(KINDS.index(kind))
    if kind == "normal":
        return torch.randn(n, k, generator=g) * 0.02
    if kind == "heavy_tailed":
        return torch.randn(n, k, generator=g) * torch.randn(n, k, generator=g).exp() * 0.02
    if kind == "outlier_column":
        w = torch.randn(n, k, generator=g)
        w[:, 7] *= 20
        return w
    if kind == "off_centre":
        return torch.rand(n, k, generator=g) * 3 + 1
    if kind == "grid":  # Q4_1-like: 16 levels per block of 32
        q = torch.randint(0, 16, (n, k), generator=g).float()
        return q * torch.rand(n, k // 32, generator=g).repeat_interleave(32, 1) * 0.01 - 0.05
    if kind == "degenerate":
        w = torch.randn(n, k, generator=g)
        w[0] = 0.0
        w[1] = 0.37
        w[2, :128] = -1.5
        return w
    raise ValueError(kind)


def _round_to_nearest_int4(w: torch.Tensor, group: int) -> torch.Tensor:
    """The quantizer before the search: min/max range, integer zero point."""
    x = w.float().reshape(w.shape[0], -1, group)
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-12)
    zero = torch.round(-low / scale).clamp(0, 15)
    return ((torch.round(x / scale) + zero).clamp(0, 15) * scale - scale * zero).reshape(w.shape)


def _group_error(w: torch.Tensor, approx: torch.Tensor, group: int) -> torch.Tensor:
    """The error the int4 search minimizes: per group, the sum of squared errors."""
    return (approx - w).reshape(w.shape[0], -1, group).square().sum(-1)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("kind", KINDS)
def test_int4_search_never_worse_than_round_to_nearest(kind, group):
    w = _weights(kind)
    packed = quantize_int4(w, group)
    assert packed.qweight.dtype == torch.uint8 and packed.qweight.shape == (48, 128)
    assert packed.scales.shape == packed.mins.shape == (48, 256 // group)
    assert packed.scales.dtype == packed.mins.dtype == torch.float32 and (packed.scales > 0).all()
    got, plain = dequantize(packed), _round_to_nearest_int4(w, group)
    slack = 1e-6 * _group_error(w, torch.zeros_like(w), group) + 1e-30
    assert (_group_error(w, got, group) <= _group_error(w, plain, group) + slack).all()
    if kind in ("normal", "heavy_tailed", "outlier_column"):  # and clearly better on the whole
        assert _group_error(w, got, group).sum() < 0.95 * _group_error(w, plain, group).sum()


def test_int4_levels_are_each_weights_nearest():
    w = _weights("heavy_tailed")
    packed = quantize_int4(w, 64)
    scales, mins = packed.scales.repeat_interleave(64, 1), packed.mins.repeat_interleave(64, 1)
    q = unpack_int4(packed.qweight).float()  # low nibble = even k, high nibble = odd k
    assert torch.equal(q, torch.round((w - mins) / scales).clamp(0, 15))
    assert torch.allclose(dequantize(packed), q * scales + mins)


def test_int4_degenerate_rows_are_exact():
    w = _weights("degenerate")
    got = dequantize(quantize_int4(w, 64))
    assert torch.equal(got[0], w[0])  # all zero
    torch.testing.assert_close(got[1], w[1], rtol=1e-6, atol=0)  # constant
    torch.testing.assert_close(got[2, :128], w[2, :128], rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_search_never_worse_than_max_scaling(kind):
    w = _weights(kind)
    packed = quantize_fp8(w)
    assert packed.qweight.dtype == torch.uint8 and packed.qweight.shape == w.shape
    assert packed.scales.dtype == torch.float32 and packed.scales.shape == (48,)
    base = w.abs().amax(1).clamp(min=1e-12) / 448
    assert (packed.scales >= base).all()  # nothing saturates: the row max maps into (224, 448]
    values = packed.qweight.view(torch.float8_e4m3fn).float()
    assert torch.equal(values, (w / packed.scales[:, None]).to(torch.float8_e4m3fn).float())  # round to nearest even
    plain = (w / base[:, None]).to(torch.float8_e4m3fn).float() * base[:, None]
    got_error, plain_error = (dequantize(packed) - w).square().sum(1), (plain - w).square().sum(1)
    assert (got_error <= plain_error).all()
    if kind in ("normal", "heavy_tailed", "outlier_column"):
        assert got_error.sum() < 0.95 * plain_error.sum()


@pytest.mark.parametrize("quantizer", [quantize_fp8, lambda w: quantize_int4(w, 64)])
def test_quantizers_are_deterministic_and_dtype_blind(quantizer):
    w = _weights("heavy_tailed").bfloat16()
    first, again, from_fp32 = quantizer(w), quantizer(w.clone()), quantizer(w.float())
    for a, b in ((first, again), (first, from_fp32)):
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
        assert torch.equal(getattr(a, "mins", a.scales), getattr(b, "mins", b.scales))
