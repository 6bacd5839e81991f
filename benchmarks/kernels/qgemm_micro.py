"""Packed Q4_1 / Q8_0 GEMM at many rows: the many-row GEMM (kernels/cpu/qgemm.h) against the
int16 passes that the same bound kernel runs below its threshold (``set_qgemm_min_rows``), torch's
fp32 matmul of the dequantized weight, and bf16 (where the CPU has bf16 units it is what a
dequantized run computes), on SmolLM2-135M's shapes, in ms (min over reps, interleaved A B C D).

    .venv/bin/python -m benchmarks.kernels.qgemm_micro [--threads 1] [--reps 10] [--m 64]

One thread by default, timed in the thread's CPU time: on a shared machine that is the figure
that compares the kernels (with more threads, the least wall time).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from benchmarks.harness import best_of, cpu_line
from llmctl.layers.quantization.quantize import quantize_int4, quantize_int8
from llmctl_kernels.packed_formats import PackedInt4, PackedInt8, dequantize
from llmctl_kernels.quant_native import bind_native, load_quant_native

# name, N, K, format: SmolLM2-135M's layers (Q4_1) and its tied Q8_0 LM head
SHAPES = [
    ("qkv", 960, 576, "Q4_1"),
    ("o", 576, 576, "Q4_1"),
    ("gate-up", 3072, 576, "Q4_1"),
    ("down", 576, 1536, "Q4_1"),
    ("LM head", 49152, 576, "Q8_0"),
]


def _gguf_like(n: int, k: int, fmt: str):
    """A packed weight as a GGUF file holds it: groups of 32, float16 scales (and mins)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    if fmt == "Q4_1":
        p = quantize_int4(w, 32)
        return PackedInt4(p.qweight, p.scales.half(), p.mins.half(), 32)
    p = quantize_int8(w, 32)
    return PackedInt8(p.qweight, p.scales.half(), None, 32)


def least_cpu_time(fn: Callable[[], object], reps: int) -> float:
    """The least thread CPU time of ``reps`` calls after a warm-up one (one thread: the kernels run in it)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--m", type=int, default=64, help="rows of x")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    timed = least_cpu_time if args.threads == 1 else best_of
    module = load_quant_native()
    print(f"CPU: {cpu_line()}; threads {args.threads}; M = {args.m}; min of {args.reps} reps, interleaved (ms)")
    print(f"{'shape':>8} {'N':>6} {'K':>5} {'many-row':>11} {'int16':>7} {'fp32 mm':>8} {'bf16 mm':>8}")
    for name, n, k, fmt in SHAPES:
        packed = _gguf_like(n, k, fmt)
        kernel = bind_native(packed)
        mins = None if packed.mins is None else packed.mins.float()
        w32 = dequantize(type(packed)(packed.qweight, packed.scales.float(), mins, 32))
        w16 = w32.bfloat16()
        x = torch.randn(args.m, k)
        x16 = x.bfloat16()
        reps = max(2, args.reps // 5) if n > 10_000 else args.reps
        times: dict[str, float] = {}

        def run(rows: int) -> float:
            previous = module.set_qgemm_min_rows(rows)
            try:
                return timed(lambda: kernel(x), reps)
            finally:
                module.set_qgemm_min_rows(previous)

        for _ in range(2):
            for label, fn in (
                ("many-row", lambda: run(1)),
                ("int16", lambda: run(1 << 30)),
                ("fp32", lambda: timed(lambda: x @ w32.t(), reps)),
                ("bf16", lambda: timed(lambda: x16 @ w16.t(), reps)),
            ):
                times[label] = min(times.get(label, float("inf")), fn() * 1e3)
        print(
            f"{name:>8} {n:>6} {k:>5} {times['many-row']:>11.3f} {times['int16']:>7.3f} {times['fp32']:>8.3f} "
            f"{times['bf16']:>8.3f}   {fmt}"
        )


if __name__ == "__main__":
    main()
