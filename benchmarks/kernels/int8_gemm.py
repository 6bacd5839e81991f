"""Per-channel int8 GEMM (kernels/cpu/int8_gemm.h: per-token int16 activations, exact integer sums)
against torch's fp32 matmul and llmctl's own fp32 panel GEMM (gemm_kernels.h, what
``--quantization none`` runs) on SmolLM2-135M's linear shapes, in GFLOP/s (2 * M * N * K / time,
the min over reps). They run interleaved, A B C A B C, so that a busy shared machine hurts all alike.

    .venv/bin/python -m benchmarks.kernels.int8_gemm [--threads 2] [--reps 7] [--m 1,64,512]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import best_of, cpu_line
from llmctl.layers.quantization.quantize import quantize_int8
from llmctl_kernels.fp32_linear import pack_panels
from llmctl_kernels.gemm_native import load_gemm_native
from llmctl_kernels.quant_native import bind_native

# (K, N): qkv 576 -> 960, o 576 -> 576, gate-up 576 -> 3072, down 1536 -> 576
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--m", default="1,64,512", help="comma-separated rows of x")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_line()}; threads {args.threads}; min of {args.reps} reps, interleaved")
    gemm = load_gemm_native()
    print(
        f"{'M':>4} {'K':>5} {'N':>5} {'torch fp32':>10} {'fp32 panels':>11} {'int8':>6} {'int8/torch':>10} "
        f"{'int8/panels':>11}   (GFLOP/s)"
    )
    for m in (int(v) for v in args.m.split(",")):
        for k, n in SHAPES:
            gen = torch.Generator().manual_seed(k * n)
            w = torch.randn(n, k, generator=gen)
            x = torch.randn(m, k, generator=gen)
            kernel = bind_native(quantize_int8(w))
            if kernel is None:
                raise SystemExit("the native quantized kernels are not available here")
            panels = pack_panels(w)
            runs = {
                "torch": lambda x=x, w=w: torch.mm(x, w.t()),
                "panels": lambda x=x, p=panels, n=n: gemm.linear(x, p, n, None),
                "int8": lambda x=x, kernel=kernel: kernel(x),
            }
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(2):  # A B C A B C
                for name, fn in runs.items():
                    best[name] = min(best[name], best_of(fn, args.reps))
            rate = {name: 2 * m * n * k / t / 1e9 for name, t in best.items()}
            print(
                f"{m:>4} {k:>5} {n:>5} {rate['torch']:>10.1f} {rate['panels']:>11.1f} {rate['int8']:>6.1f} "
                f"{rate['int8'] / rate['torch']:>9.2f}x {rate['int8'] / rate['panels']:>10.2f}x"
            )


if __name__ == "__main__":
    main()
