"""GFLOP/s of the fp32 linear layers' GEMM: the native panel kernel (kernels/cpu/gemm_kernels.cpp)
against torch's ``F.linear`` (MKL), torch with the weight prepacked for oneDNN (what llmctl used
before for large fp32 weights) and numpy (OpenBLAS), at the shapes of the 246M Llama
(``llama250m``) and SmolLM2-135M, for M = 1, 8, 64, 512 rows.

Two measurements: one thread, CPU time of the thread (``time.thread_time``: what the work costs,
little disturbed by other processes on a shared machine), and all threads (torch's count), wall
time. The contenders run interleaved (A B C D A B C D ...), best of ``--reps``.

    python benchmarks/fp32_gemm.py [--reps 5] [--rows 1,8,64,512] [--models llama250m,smollm2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from kernels.cpu_features import cpu_flags, cpu_model, isa_level
from kernels.fp32_linear import pack_panels
from kernels.gemm_native import load_gemm_native, native_unavailable_reason

# (name, in_features K, out_features N) of each linear layer (merged QKV and gate-up, as llmctl holds them)
SHAPES = {
    "llama250m": [("qkv", 1024, 1536), ("o", 1024, 1024), ("gate_up", 1024, 5632), ("down", 2816, 1024),
                  ("lm_head", 1024, 32000)],
    "smollm2": [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
                ("lm_head", 576, 49152)],
}
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile")


def _numpy_threads(count: int):
    """Caps OpenBLAS's threads (threadpoolctl, when installed); None: numpy is left out."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(limits=count)


def contenders(k: int, n: int) -> dict[str, Callable[[torch.Tensor], object]]:
    w = torch.randn(n, k) / k ** 0.5
    out: dict[str, Callable[[torch.Tensor], object]] = {"torch": lambda x: F.linear(x, w)}
    with contextlib.suppress(RuntimeError, AttributeError):
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
        out["oneDNN prepacked"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
    wt = np.ascontiguousarray(w.numpy().T)
    out["numpy"] = lambda x: x.numpy() @ wt
    module = load_gemm_native()
    if module is not None:
        packed = pack_panels(w)
        out["native"] = lambda x: module.linear(x, packed, n, None)
    return out


def measure(fns: dict[str, Callable], x: torch.Tensor, reps: int, clock: Callable[[], float]) -> dict[str, float]:
    best = {name: float("inf") for name in fns}
    for fn in fns.values():  # warm-up (first-touch, oneDNN's primitive cache)
        fn(x)
    for _ in range(reps):
        for name, fn in fns.items():
            start = clock()
            fn(x)
            best[name] = min(best[name], clock() - start)
    return best


def run(models: list[str], rows: list[int], reps: int, threads: int) -> None:
    torch.set_num_threads(threads)
    limiter = _numpy_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    what = "1 thread, CPU time" if threads == 1 else f"{threads} threads, wall time"
    print(f"\n### GFLOP/s, {what} (best of {reps})\n")
    names = None
    for model in models:
        for layer, k, n in SHAPES[model]:
            fns = contenders(k, n)
            if limiter is None:
                fns.pop("numpy")
            if names is None:
                names = list(fns)
                print("| model | layer | K → N | M | " + " | ".join(names) + " | native / best other |")
                print("|---|---|---|---:|" + "---:|" * (len(names) + 1))
            for m in rows:
                x = torch.randn(m, k)
                best = measure(fns, x, max(2, reps if m * k * n < 2e9 else reps // 2), clock)
                rate = {name: 2 * m * k * n / t / 1e9 for name, t in best.items()}
                others = max(v for name, v in rate.items() if name != "native")
                ratio = f"{rate['native'] / others:.2f}×" if "native" in rate else "—"
                print(f"| {model} | {layer} | {k} → {n} | {m} | "
                      + " | ".join(f"{rate[name]:.1f}" for name in names) + f" | {ratio} |", flush=True)
    if limiter is not None:
        limiter.restore_original_limits()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rows", default="1,8,64,512")
    parser.add_argument("--models", default="llama250m,smollm2")
    parser.add_argument("--threads", default=f"1,{torch.get_num_threads()}", help="thread counts to run")
    args = parser.parse_args()
    flags = " ".join(f for f in ISA_FLAGS if f in cpu_flags())
    module = load_gemm_native()
    print(f"CPU: {cpu_model()} ({os.cpu_count()} CPUs; {flags}); native GEMM: "
          f"{isa_level() if module else native_unavailable_reason()}; torch {torch.__version__}; "
          f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    for threads in dict.fromkeys(int(t) for t in args.threads.split(",")):
        run(args.models.split(","), [int(m) for m in args.rows.split(",")], args.reps, threads)
    print(f"\nload average at the end {' '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
