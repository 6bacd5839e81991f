"""Per-channel int8 GEMM (kernels/cpu/int8_gemm.h: per-token int16 activations, exact integer sums)
against torch's fp32 matmul on SmolLM2-135M's linear shapes, in GFLOP/s (2 * M * N * K / time,
the min over reps). Both run interleaved, A B A B, so that a busy shared machine hurts both alike.

    PYTHONPATH=. .venv/bin/python benchmarks/int8_gemm.py [--threads 2] [--reps 7] [--m 1,64,512]
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time

import torch

from kernels.quant_native import bind_native
from llmctl.layers.quantization.quantize import quantize_int8

# (K, N): qkv 576 -> 960, o 576 -> 576, gate-up 576 -> 3072, down 1536 -> 576
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]


def cpu_line() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
        model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")
        flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags")), [])
        isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
        return f"{model or platform.processor()} ({', '.join(isa)})"
    except (OSError, subprocess.SubprocessError):
        return platform.processor()


def best_time(fn, reps: int) -> float:
    fn()  # warm caches and the thread pool
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--m", default="1,64,512", help="comma-separated rows of x")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_line()}; threads {args.threads}; min of {args.reps} reps, interleaved")
    print(f"{'M':>4} {'K':>5} {'N':>5} {'fp32 mm GF/s':>13} {'int8 GF/s':>10} {'speed-up':>9}")
    for m in (int(v) for v in args.m.split(",")):
        for k, n in SHAPES:
            gen = torch.Generator().manual_seed(k * n)
            w = torch.randn(n, k, generator=gen)
            x = torch.randn(m, k, generator=gen)
            kernel = bind_native(quantize_int8(w))
            if kernel is None:
                raise SystemExit("the native quantized kernels are not available here")
            fp32_times, int8_times = [], []
            for _ in range(2):  # A B A B
                fp32_times.append(best_time(lambda x=x, w=w: torch.mm(x, w.t()), args.reps))
                int8_times.append(best_time(lambda x=x, kernel=kernel: kernel(x), args.reps))
            flop = 2 * m * n * k
            fp32, int8 = flop / min(fp32_times) / 1e9, flop / min(int8_times) / 1e9
            print(f"{m:>4} {k:>5} {n:>5} {fp32:>13.1f} {int8:>10.1f} {int8 / fp32:>8.2f}x")


if __name__ == "__main__":
    main()
