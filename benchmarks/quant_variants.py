"""Rounding variants tried against llmctl's quantizers (issue 12), weights only: each linear weight is
replaced by dequantize(quantize(w)) and the model runs in float32, so the figure is the weights'
rounding alone (no int16/int8 activations, no kernels). Prints perplexity and the mean KL
divergence from the float32 model (see quant_quality.py) on TEXT.

    python benchmarks/quant_variants.py ../shared/models/stories260k
    python benchmarks/quant_variants.py smollm2-135m

Calibration-free variants (int4 at group 64, fp8 per output channel):
- int4-rtn: min/max with an integer zero point, round to nearest (llmctl before the search);
- int4: llmctl's quantize_int4 (least-squares scale/min search, as llama.cpp's make_qkx2_quants searches);
- int4-float-min: min/max with a float min (Q4_1-style);
- int4-hqq: HQQ (half-quadratic, lp-norm p=0.7) optimisation of the zero point, scale fixed;
- fp8-rtn: the row's max mapped to 448 (llmctl before the search);
- fp8: llmctl's quantize_fp8 (per-row least-squared-error scale);
- fp8-pow2: the scale rounded up to a power of two.
Data-aware variants (GPTQ, Frantar et al. 2022), calibrated on CALIBRATION only (default
benchmarks/data/calibration_stories.txt, written for this purpose; never the evaluation text):
- int4-gptq: GPTQ's column-by-column rounding with error feedback through the inverse Hessian of
  each layer's calibration inputs, group parameters from quantize_int4 on the updated weights;
- fp8-gptq: the same with quantize_fp8's per-row scales and e4m3 rounding.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_quality import load_quantized, load_tokenizer, prefill_logits, score

from llmctl.layers.linear import LinearBase
from llmctl.layers.quantization import (
    dequantize,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)

GROUP = 64
DATA = Path(__file__).parent / "data"


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


def gptq(w: torch.Tensor, hessian: torch.Tensor, kind: str, block: int = 128, damp: float = 0.01) -> torch.Tensor:
    """GPTQ (the reference algorithm's structure: lazy block updates, Cholesky of the inverse
    Hessian, 1 % damping). Each weight is rounded in turn and its error spread over the columns not
    yet rounded, weighted by how the calibration inputs correlate."""
    w, h = w.float().clone(), hessian.double().clone()
    k = w.shape[1]
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * h.diagonal().mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    out = torch.zeros_like(w)
    fp8_scales = quantize_fp8(w).scales[:, None] if kind == "fp8" else None
    scales = mins = None
    for start in range(0, k, block):
        end = min(start + block, k)
        part, errors = w[:, start:end].clone(), torch.zeros(w.shape[0], end - start)
        for i in range(end - start):
            column = part[:, i]
            if kind == "int4":
                if (start + i) % GROUP == 0:  # this group's scale/min, from its current (updated) weights
                    group = part[:, i : i + GROUP] if i + GROUP <= end - start else w[:, start + i : start + i + GROUP]
                    packed = quantize_int4(group.contiguous(), GROUP)
                    scales, mins = packed.scales[:, 0], packed.mins[:, 0]
                rounded = torch.round((column - mins) / scales).clamp(0, 15) * scales + mins
            else:
                rounded = _fp8(column[:, None], fp8_scales)[:, 0]
            out[:, start + i] = rounded
            error = (column - rounded) / hinv[start + i, start + i]
            part[:, i:] -= error[:, None] * hinv[start + i, start + i : end][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ hinv[start:end, end:]
    return out


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
DATA_AWARE = {"int4-gptq": "int4", "fp8-gptq": "fp8"}


def input_hessians(model, layers: list[LinearBase], tokens: list[int], window: int) -> list[torch.Tensor]:
    """Per layer, sum of x x^T over the calibration tokens' inputs to it (padded to its weight's width)."""
    hessians = [None] * len(layers)

    def hook(index: int):
        def accumulate(module, inputs):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            update = x.t() @ x
            hessians[index] = update if hessians[index] is None else hessians[index] + update
        return accumulate

    handles = [layer.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    with torch.inference_mode():
        for start in range(0, len(tokens) - 1, window):
            chunk = tokens[start : start + window]
            if len(chunk) >= 2:
                prefill_logits(model, chunk)
    for handle in handles:
        handle.remove()
    return hessians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a float checkpoint directory, a .gguf file or a packaged model name")
    parser.add_argument("--text", type=Path, default=DATA / "fables.txt")
    parser.add_argument("--calibration", type=Path, default=DATA / "calibration_stories.txt")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--variants", default=",".join([*VARIANTS, *DATA_AWARE]))
    args = parser.parse_args()
    if args.calibration.resolve() == args.text.resolve():
        parser.error("calibrating on the evaluation text would measure nothing")
    tokenizer = load_tokenizer(args.model)
    tokens = tokenizer.encode(args.text.read_text())
    with mock.patch("llmctl.layers.linear.prepack_for_cpu", return_value=None):  # plain [N, K] float32 weights
        model = load_quantized(args.model, "none", GROUP)
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    originals = [layer.weight.data.clone() for layer in layers]
    names = args.variants.split(",")
    hessians = None
    if any(name in DATA_AWARE for name in names):
        hessians = input_hessians(model, layers, tokenizer.encode(args.calibration.read_text()), args.window)
    base = reference = None
    for name in names:
        with torch.no_grad():
            for index, (layer, weight) in enumerate(zip(layers, originals)):
                padding = -weight.shape[1] % 128  # whole groups: zero columns, as the loader pads
                padded = F.pad(weight, (0, padding)) if padding else weight
                if name in DATA_AWARE:
                    h = F.pad(hessians[index], (0, padding, 0, padding))
                    rounded = gptq(padded, h, DATA_AWARE[name])
                else:
                    rounded = VARIANTS[name](padded)
                layer.weight.data.copy_(rounded[:, : weight.shape[1]])
        ppl, _, kld, logprobs = score(model, tokens, args.window, reference)
        base, reference = base or ppl, reference or logprobs
        print(f"{name:16s} perplexity {ppl:8.4f}  ({100 * (ppl / base - 1):+6.2f} %)  KLD {kld:.5f}", flush=True)


if __name__ == "__main__":
    main()
