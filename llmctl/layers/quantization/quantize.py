"""On-the-fly quantization of a float ``[N, K]`` weight into the packed formats of ``formats.py``.

Each function works in float32 whatever the input dtype, so a bf16 checkpoint and its fp32 copy
quantize to the same packed weight. No calibration data: int4 and fp8 choose their scales (and int4
its mins) by searching for the least squared error of the weights themselves; each search
starts from plain round-to-nearest and keeps it wherever it is not beaten, so a weight's error is
never larger than before (docs/benchmarks.md, "Quantized weights: quality", has the perplexities).
"""

from __future__ import annotations

import math

import torch

from llmctl_kernels.packed_formats import PackedFp8, PackedInt4, PackedInt8

FP8_E4M3_MAX = 448.0
_TINY = 1e-12  # keeps all-zero groups from dividing by zero (they quantize to exact zeros)
_FP8_SCALES_PER_OCTAVE = 32  # e4m3's grid repeats when the scale doubles: one octave holds every alignment
_FP8_PHASE_BINS = 256  # resolution of a row's log2-position histogram (its error is exact to ~0.3 %)
_INT4_SEARCH_STEPS = 21  # llama.cpp's make_qkx2_quants: 15 levels +- 1 in steps of 0.1
_INT4_REFINE_STEPS = 3
_INT4_CHUNK_GROUPS = 4096  # groups per pass of the int4 search: few calls, buffers still in cache


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    if group_size < 1 or k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input features ({k})")
    return w.float().reshape(n, k // group_size, group_size)


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> PackedInt8:
    """Symmetric int8 in -127..127 (so that negating stays in range), one scale per output channel
    (``group_size=None``) or per group of ``group_size`` inputs."""
    group_size = group_size or w.shape[1]
    groups = _groups(w, group_size)
    scales = groups.abs().amax(dim=-1).clamp(min=_TINY) / 127.0
    q = torch.round(groups / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return PackedInt8(q.reshape(w.shape).contiguous(), scales.contiguous(), None, group_size)


# ---- int4 ----------------------------------------------------------------------------------------
def _int4_levels(x: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    return torch.round((x - mins[:, None]) / scales[:, None]).clamp_(0, 15)


def _int4_error(x: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Per group: sum of (dequantized - x)^2, each weight rounded to its nearest level."""
    rounded = _int4_levels(x, scales, mins).mul_(scales[:, None]).add_(mins[:, None]).sub_(x)
    return rounded.square_().sum(-1)


def _level_sums(levels: torch.Tensor, x: torch.Tensor, scratch: torch.Tensor, out: torch.Tensor) -> None:
    """``out[0..2]`` = per group sum(levels), sum(levels * x) and sum(levels^2). In a ``scratch``
    buffer: a fresh tensor per step costs more than the arithmetic (each is a new memory map)."""
    torch.sum(levels, -1, out=out[0])
    torch.sum(torch.mul(levels, x, out=scratch), -1, out=out[1])
    torch.sum(torch.mul(levels, levels, out=scratch), -1, out=out[2])


def _int4_fit(moments: tuple[torch.Tensor, ...], sums: torch.Tensor):
    """Least squares of ``x ~ scale * levels + min`` for each candidate's levels (``sums``:
    ``[3, candidates, groups]`` from ``_level_sums``), and its squared error, in float64 (the error
    is a small difference of large sums). A fit without a positive scale gets an infinite error."""
    count, sum_x, sum_xx = moments
    sum_l, sum_xl, sum_ll = sums.double()
    det = count * sum_ll - sum_l * sum_l
    solvable = det > 0
    det = torch.where(solvable, det, torch.ones_like(det))
    scale = (count * sum_xl - sum_x * sum_l) / det
    low = (sum_ll * sum_x - sum_l * sum_xl) / det
    error = (
        scale * scale * sum_ll
        + 2 * scale * low * sum_l
        + low * low * count
        - 2 * scale * sum_xl
        - 2 * low * sum_x
        + sum_xx
    )
    return scale, low, torch.where(solvable & (scale > 0), error, torch.full_like(error, math.inf))


def _int4_search(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and min of each row of ``x`` (one group each) with the least squared error, searched
    as llama.cpp's ``make_qkx2_quants`` (its Q4_K quantizer) searches: the levels of 21 scales
    between ``range / 16`` and ``range / 14`` (from the group's min) are each fitted by least
    squares, the best kept, then refitted to its own rounding a few times. Unweighted: llama.cpp's
    no-imatrix weighting (``rms + |w|``) did worse on the text it was chosen on (docs/benchmarks.md,
    "What was tried and not kept"). Starts from plain round-to-nearest (integer zero point, or float min where
    better): no group's error grows."""
    low, high = x.amin(-1), x.amax(-1)
    span = (high - low).clamp(min=_TINY)
    scale = span / 15.0
    zero_point_min = -scale * torch.round(-low / scale).clamp(0, 15)  # the integer zero point of AWQ/GPTQ
    start_error = _int4_error(x, scale, zero_point_min)
    minmax_error = _int4_error(x, scale, low)
    start_min = torch.where(minmax_error < start_error, low, zero_point_min)
    start_error = torch.minimum(minmax_error, start_error)

    moments = (torch.full_like(low, x.shape[1], dtype=torch.float64), x.sum(-1).double(), x.square().sum(-1).double())
    offset, levels, scratch = x - low[:, None], torch.empty_like(x), torch.empty_like(x)
    sums = torch.empty(3, _INT4_SEARCH_STEPS, x.shape[0], device=x.device)
    for step in range(_INT4_SEARCH_STEPS):
        levels_per_span = 14.0 + 2.0 * step / (_INT4_SEARCH_STEPS - 1)  # 14 .. 16
        torch.mul(offset, (levels_per_span / span)[:, None], out=levels).round_().clamp_(0, 15)
        _level_sums(levels, x, scratch, sums[:, step])
    scales, mins, errors = _int4_fit(moments, sums)
    pick = errors.argmin(0, keepdim=True)
    best_scale, best_min, best_error = (t.gather(0, pick)[0] for t in (scales, mins, errors))
    better = best_error < start_error
    best_scale, best_min = (
        torch.where(better, best_scale, scale.double()),
        torch.where(better, best_min, start_min.double()),
    )
    best_error = torch.where(better, best_error, start_error.double())
    for _ in range(_INT4_REFINE_STEPS):  # refit the levels the best fit rounds to
        _level_sums(_int4_levels(x, best_scale.float(), best_min.float()), x, scratch, sums[:, 0])
        scales, mins, errors = (t[0] for t in _int4_fit(moments, sums[:, :1]))
        better = errors < best_error
        best_scale, best_min = torch.where(better, scales, best_scale), torch.where(better, mins, best_min)
        best_error = torch.where(better, errors, best_error)
    # The fits' errors assume the levels they were fitted to; rounding each weight to its nearest
    # level can only lower them, but float32 rounding could not: check, keep the start otherwise.
    found_scale, found_min = best_scale.float(), best_min.float()
    improved = _int4_error(x, found_scale, found_min) <= start_error
    return torch.where(improved, found_scale, scale), torch.where(improved, found_min, start_min)


def quantize_int4(w: torch.Tensor, group_size: int = 64) -> PackedInt4:
    """Asymmetric int4: per group, ``w ~ scale * q + min`` with ``q`` in 0..15 (the scale and the
    float min searched by ``_int4_search``); two weights per byte."""
    if group_size not in (32, 64, 128):
        raise ValueError(f"int4 group size must be 32, 64 or 128, got {group_size}")
    n, k = w.shape
    groups = _groups(w, group_size).reshape(-1, group_size)
    scales, mins = torch.empty(groups.shape[0], device=w.device), torch.empty(groups.shape[0], device=w.device)
    for start in range(0, groups.shape[0], _INT4_CHUNK_GROUPS):
        part = slice(start, start + _INT4_CHUNK_GROUPS)
        scales[part], mins[part] = _int4_search(groups[part])
    q = _int4_levels(groups, scales, mins).to(torch.uint8).reshape(n, k)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)  # low nibble = even k, high nibble = odd k
    return PackedInt4(
        packed.contiguous(), scales.reshape(n, -1).contiguous(), mins.reshape(n, -1).contiguous(), group_size
    )


# ---- fp8 -----------------------------------------------------------------------------------------
def _fp8_relative_error_squared(phase: torch.Tensor) -> torch.Tensor:
    """Squared relative error of rounding ``2**(e + phase)`` to e4m3's 3 mantissa bits (normal range)."""
    mantissa = torch.exp2(phase) - 1
    return ((mantissa * 8 - torch.round(mantissa * 8)) / (8 * (1 + mantissa))).square()


def _fp8_round_trip(w: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = (w / scales[:, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, (q.float() * scales[:, None] - w).square_().sum(1)


def _fp8_search(w: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The per-row scale, among 32 per octave above ``base`` (row max -> 448: nothing saturates),
    with the least squared error. e4m3's relative rounding error depends only on where ``log2|w/s|``
    falls within its octave, so each row's squared weights are binned by that position once and
    every candidate's error is a sum over the bins: one matrix product instead of 32 roundings."""
    position = torch.log2(w.abs() / base[:, None])
    phase = position - torch.floor(position)
    bins = (phase * _FP8_PHASE_BINS).nan_to_num_(0).long().clamp_(0, _FP8_PHASE_BINS - 1)  # zeros: weight 0
    energy = torch.zeros(w.shape[0], _FP8_PHASE_BINS, device=w.device).scatter_add_(1, bins, w.square())
    shifts = torch.arange(_FP8_PHASE_BINS, device=w.device)[:, None] - torch.arange(
        _FP8_SCALES_PER_OCTAVE, device=w.device
    )[None, :] * (_FP8_PHASE_BINS // _FP8_SCALES_PER_OCTAVE)
    table = _fp8_relative_error_squared(((shifts % _FP8_PHASE_BINS) + 0.5) / _FP8_PHASE_BINS)
    best = (energy.double() @ table.double()).argmin(1)
    return base * torch.exp2(best.float() / _FP8_SCALES_PER_OCTAVE)


def quantize_fp8(w: torch.Tensor) -> PackedFp8:
    """float8 e4m3fn (round to nearest even, saturating at 448) with one float32 scale per output
    channel: the scale with the least squared error (``_fp8_search``), or row max -> 448 where that
    is at least as good (checked exactly, row by row)."""
    w = w.float()
    base = w.abs().amax(dim=1).clamp(min=_TINY) / FP8_E4M3_MAX
    searched = _fp8_search(w, base)
    q_base, error_base = _fp8_round_trip(w, base)
    q_searched, error_searched = _fp8_round_trip(w, searched)
    better = error_searched < error_base
    q = torch.where(better[:, None], q_searched.view(torch.uint8), q_base.view(torch.uint8))
    return PackedFp8(q.contiguous(), torch.where(better, searched, base).contiguous())


def quantize(w: torch.Tensor, kind: str, group_size: int | None = None):
    """``kind`` is ``int8`` (``group_size`` None = per channel), ``int4`` (group 32/64/128) or
    ``fp8`` (per channel; ``group_size`` ignored)."""
    if kind == "int8":
        return quantize_int8(w, group_size)
    if kind == "int4":
        return quantize_int4(w, group_size or 64)
    if kind == "fp8":
        return quantize_fp8(w)
    raise ValueError(f"unknown quantization {kind!r}; choose none, int8, int4 or fp8")
