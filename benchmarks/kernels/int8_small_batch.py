"""Per-channel int8 GEMM (kernels/cpu/int8_gemm.h) at the small batches of a few concurrent
requests, with the weights cold: it cycles over WEIGHTS distinct 3072 x 576 weights (SmolLM2's
gate-up shape; 40 of them, 70 MB, more than the L3 caches here), so every call streams its weight
from memory, as a decode step does. Prints microseconds a call (best of 5 passes) for each M.

    .venv/bin/python -m benchmarks.kernels.int8_small_batch [--threads 2] [--m 1,2,3,4,5,6,8,12]
    LLMCTL_CPU_ISA=avx2 PYTHONPATH=. ...   # the AVX2 tile on a VNNI CPU
"""

from __future__ import annotations

import argparse
import time

import torch

from llmctl.layers.quantization.quantize import quantize_int8
from llmctl_kernels.quant_native import bind_native

N, K, WEIGHTS = 3072, 576, 40


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--m", default="1,2,3,4,5,6,8,12", help="comma-separated rows of x")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    kernels = [bind_native(quantize_int8(torch.randn(N, K, generator=gen))) for _ in range(WEIGHTS)]
    if kernels[0] is None:
        raise SystemExit("the native quantized kernels are not available here")
    for m in (int(v) for v in args.m.split(",")):
        x = torch.randn(m, K, generator=gen)
        for kernel in kernels:  # warm the code and the thread pool
            kernel(x)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for kernel in kernels:
                kernel(x)
            best = min(best, time.perf_counter() - start)
        per_call = best / WEIGHTS
        print(f"M={m:3d}: {per_call * 1e6:7.1f} us a call, {N * K / per_call / 1e9:5.1f} GB/s of int8 weights")


if __name__ == "__main__":
    main()
