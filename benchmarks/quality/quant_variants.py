"""Rounding variants tried against llmctl's quantizers, weights only: each linear weight is
replaced by dequantize(quantize(w)) and the model runs in float32, so the figure is the weights'
rounding alone (no int16/int8 activations, no kernels). Prints perplexity and the mean KL
divergence from the float32 model (see quant_quality.py) on TEXT.

    python -m benchmarks.quality.quant_variants ../shared/models/stories260k
    python -m benchmarks.quality.quant_variants smollm2-135m

Calibration-free variants (int4 at group 64, fp8 per output channel):
- int4-rtn: min/max with an integer zero point, round to nearest (llmctl before the search);
- int4: llmctl's quantize_int4 (least-squares scale/min search, as llama.cpp's make_qkx2_quants searches);
- int4-float-min: min/max with a float min (Q4_1-style);
- int4-hqq: HQQ (half-quadratic, lp-norm p=0.7) optimisation of the zero point, scale fixed;
- fp8-rtn: the row's max mapped to 448 (llmctl before the search);
- fp8: llmctl's quantize_fp8 (per-row least-squared-error scale);
- fp8-pow2: the scale rounded up to a power of two.
Data-aware rounding (GPTQ) is llmctl's own ``--calibration``: measure it with
``python -m benchmarks.quality.quant_quality MODEL --kinds none,int4:64,int4:64+builtin``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from benchmarks.quality.quant_quality import load_quantized, load_tokenizer, score
from llmctl.layers.linear import LinearBase
from llmctl.layers.quantization import (
    dequantize,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)

GROUP = 64
DATA = Path(__file__).parents[1] / "data"


def _groups(w: torch.Tensor) -> torch.Tensor:
    return w.float().reshape(w.shape[0], -1, GROUP)


def int4_rtn(w: torch.Tensor) -> torch.Tensor:
    x = _groups(w)
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-12)
    zero = torch.round(-low / scale).clamp(0, 15)
    return ((torch.round(x / scale) + zero).clamp(0, 15) * scale - scale * zero).reshape(w.shape)


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


def _fp8(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (w / scales).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scales


def fp8_rtn(w: torch.Tensor) -> torch.Tensor:
    w = w.float()
    return _fp8(w, w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448)


def fp8_pow2(w: torch.Tensor) -> torch.Tensor:
    w = w.float()
    amax = w.abs().amax(1, keepdim=True).clamp(min=1e-12)
    return _fp8(w, torch.exp2(torch.ceil(torch.log2(amax / 448))))


VARIANTS = {
    "none": lambda w: w,
    "int8": lambda w: dequantize(quantize_int8(w)),
    "fp8-rtn": fp8_rtn,
    "fp8": lambda w: dequantize(quantize_fp8(w)),
    "fp8-pow2": fp8_pow2,
    "int4-rtn": int4_rtn,
    "int4": lambda w: dequantize(quantize_int4(w, GROUP)),
    "int4-float-min": int4_float_min,
    "int4-hqq": int4_hqq,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a float checkpoint directory, a .gguf file or a packaged model name")
    parser.add_argument("--text", type=Path, default=DATA / "fables.txt")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    tokens = tokenizer.encode(args.text.read_text())
    with mock.patch("llmctl.layers.linear.prepack_for_cpu", return_value=None):  # plain [N, K] float32 weights
        model = load_quantized(args.model, "none", GROUP)
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    originals = [layer.weight.data.clone() for layer in layers]
    names = args.variants.split(",")
    base = reference = None
    for name in names:
        with torch.no_grad():
            for layer, weight in zip(layers, originals):
                padding = -weight.shape[1] % 128  # whole groups: zero columns, as the loader pads
                padded = F.pad(weight, (0, padding)) if padding else weight
                rounded = VARIANTS[name](padded)
                layer.weight.data.copy_(rounded[:, : weight.shape[1]])
        ppl, _, kld, logprobs = score(model, tokens, args.window, reference)
        base, reference = base or ppl, reference or logprobs
        print(f"{name:16s} perplexity {ppl:8.4f}  ({100 * (ppl / base - 1):+6.2f} %)  KLD {kld:.5f}", flush=True)


if __name__ == "__main__":
    main()
