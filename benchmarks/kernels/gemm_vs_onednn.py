"""GFLOP/s of the native fp32 panel GEMM (``llmctl_gemm.linear``) against oneDNN's linear with the
weight prepacked, interleaved, best of 5, over the 246M Llama's five linear shapes at M = 64 and 512
rows; each shape's figure and the total ("ALL"). Used to choose the AVX-512 tile (docs/benchmarks.md,
"fp32 GEMM"): edit ``CHAINS`` / ``ROWS`` of the ``avx512`` namespace in
kernels/cpu/gemm_kernels.h, then rerun.

    python -m benchmarks.kernels.gemm_vs_onednn [THREADS, e.g. 1,2]
"""

from __future__ import annotations

import sys
import time

import torch

from llmctl_kernels.fp32_linear import pack_panels
from llmctl_kernels.gemm_native import EXTENSION

SHAPES = [(1024, 1536), (1024, 1024), (1024, 5632), (2816, 1024), (1024, 32000)]  # (K, N)


def main() -> None:
    native = EXTENSION.require()
    torch.manual_seed(0)
    for threads in (int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "1,2").split(",")):
        torch.set_num_threads(threads)
        print(f"threads {threads}:")
        for m in (64, 512):
            flops = native_s = onednn_s = 0.0
            for k, n in SHAPES:
                weight, x = torch.randn(n, k), torch.randn(m, k)
                packed = pack_panels(weight)
                prepacked = torch.ops.mkldnn._reorder_linear_weight(weight, None)
                fns = {
                    "native": lambda: native.linear(x, packed, n, None),
                    "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, prepacked, None, "none", [], ""),
                }
                best = dict.fromkeys(fns, float("inf"))
                for _ in range(2):
                    for fn in fns.values():
                        fn()
                for _ in range(5):
                    for name, fn in fns.items():
                        start = time.perf_counter()
                        fn()
                        best[name] = min(best[name], time.perf_counter() - start)
                f = 2 * m * k * n
                flops, native_s, onednn_s = flops + f, native_s + best["native"], onednn_s + best["onednn"]
                print(f"  M{m} {k}->{n}: native {f / best['native'] / 1e9:.0f} oneDNN {f / best['onednn'] / 1e9:.0f}")
            print(f"  M{m} ALL: native {flops / native_s / 1e9:.0f} oneDNN {flops / onednn_s / 1e9:.0f}")


if __name__ == "__main__":
    main()
