"""Calibration-free int4 / fp8 rounding variants tried against llmctl's quantizers (issue 12), weights
only: each linear weight is replaced by dequantize(quantize(w)) and the model runs in float32, so
the figure is the weights' rounding alone (no int8 activations, no kernels).

    python benchmarks/quant_variants.py ../shared/models/stories260k
    python benchmarks/quant_variants.py smollm2-135m

Variants (int4 at group 64, fp8 per output channel):
- int4: llmctl's min/max with an integer zero point (quantize_int4);
- int4-float-min: min/max with a float min (Q4_1-style);
- int4-hqq: HQQ (half-quadratic, lp-norm p=0.7) optimisation of the zero point, scale fixed;
- int4-lsq: alternating least squares of (scale, min) over the rounded levels (as llama.cpp's
  make_qkx does, unweighted), from the min/max start;
- fp8: llmctl's per-channel e4m3, the row's max mapped to 448 (quantize_fp8);
- fp8-search: per row, the scale among 25 fractions (1.00 .. 0.76) of that with the least
  squared error (= least output error for uncorrelated unit-variance inputs);
- fp8-pow2: the scale rounded up to a power of two.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_quality import load_quantized, load_tokenizer, perplexity  # noqa: E402

from llmctl.layers.linear import LinearBase  # noqa: E402
from llmctl.layers.quantization import dequantize, quantize_fp8, quantize_int4, quantize_int8  # noqa: E402

GROUP = 64


def _groups(w: torch.Tensor) -> torch.Tensor:
    return w.float().reshape(w.shape[0], -1, GROUP)


def int4_float_min(w: torch.Tensor) -> torch.Tensor:
    x = _groups(w)
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-12)
    return (torch.round((x - low) / scale).clamp(0, 15) * scale + low).reshape(w.shape)


def int4_hqq(w: torch.Tensor, iters: int = 20, p: float = 0.7, beta: float = 10.0, kappa: float = 1.01) -> torch.Tensor:
    x = _groups(w)
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-12)
    zero = best_zero = -low / scale
    best_error = None
    for _ in range(iters):
        q = torch.round(x / scale + zero).clamp(0, 15)
        error = x - scale * (q - zero)
        shrunk = torch.sign(error) * torch.relu(error.abs() - error.abs().clamp(min=1e-8).pow(p - 1) / beta)
        zero = (q - (x - shrunk) / scale).mean(-1, keepdim=True)
        beta *= kappa
        total = (x - scale * (torch.round(x / scale + zero).clamp(0, 15) - zero)).abs().mean()
        if best_error is None or total < best_error:
            best_error, best_zero = total, zero
    return (scale * (torch.round(x / scale + best_zero).clamp(0, 15) - best_zero)).reshape(w.shape)


def int4_lsq(w: torch.Tensor, iters: int = 4) -> torch.Tensor:
    x = _groups(w)
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale, low = ((high - low) / 15).clamp(min=1e-12), low
    n = x.shape[-1]
    for _ in range(iters):
        q = torch.round((x - low) / scale).clamp(0, 15)
        sq, sq2, sx, sqx = q.sum(-1, True), (q * q).sum(-1, True), x.sum(-1, True), (q * x).sum(-1, True)
        det = n * sq2 - sq * sq
        ok = det.abs() > 1e-20
        safe = torch.where(ok, det, torch.ones_like(det))
        scale = torch.where(ok, (n * sqx - sq * sx) / safe, scale).clamp(min=1e-12)
        low = torch.where(ok, (sq2 * sx - sq * sqx) / safe, low)
    return (torch.round((x - low) / scale).clamp(0, 15) * scale + low).reshape(w.shape)


def _fp8(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (w / scales).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scales


def fp8_search(w: torch.Tensor) -> torch.Tensor:
    w = w.float()
    amax = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
    best, best_error = None, None
    for fraction in [1.0 - 0.01 * i for i in range(25)]:
        candidate = _fp8(w, amax * fraction)
        error = (candidate - w).square().sum(1, keepdim=True)
        if best is None:
            best, best_error = candidate, error
        else:
            better = error < best_error
            best, best_error = torch.where(better, candidate, best), torch.where(better, error, best_error)
    return best


def fp8_pow2(w: torch.Tensor) -> torch.Tensor:
    w = w.float()
    amax = w.abs().amax(1, keepdim=True).clamp(min=1e-12)
    return _fp8(w, torch.exp2(torch.ceil(torch.log2(amax / 448))))


VARIANTS = {
    "none": lambda w: w,
    "int8": lambda w: dequantize(quantize_int8(w)),
    "fp8": lambda w: dequantize(quantize_fp8(w)),
    "fp8-search": fp8_search,
    "fp8-pow2": fp8_pow2,
    "int4": lambda w: dequantize(quantize_int4(w, GROUP)),
    "int4-float-min": int4_float_min,
    "int4-hqq": int4_hqq,
    "int4-lsq": int4_lsq,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a float checkpoint directory, a .gguf file or a packaged model name")
    parser.add_argument("--text", type=Path, default=Path(__file__).parent / "data" / "fables.txt")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    tokens = load_tokenizer(args.model).encode(args.text.read_text())
    model = load_quantized(args.model, "none", GROUP)
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    originals = [layer.weight.data.clone() for layer in layers]
    base = None
    for name in args.variants.split(","):
        with torch.no_grad():
            for layer, weight in zip(layers, originals):
                padding = -weight.shape[1] % 128  # whole groups: zero columns, as the loader pads
                rounded = VARIANTS[name](F.pad(weight, (0, padding)) if padding else weight)
                layer.weight.data.copy_(rounded[:, : weight.shape[1]])
        ppl, _ = perplexity(model, tokens, args.window)
        base = base or ppl
        print(f"{name:16s} perplexity {ppl:8.4f}  ({100 * (ppl / base - 1):+6.2f} %)", flush=True)


if __name__ == "__main__":
    main()
