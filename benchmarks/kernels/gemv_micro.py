"""One quantized GEMV shape at a time: the row layout (qweight, scales, mins as separate arrays)
against the tile-interleaved layout (``interleave_tiles``), interleaved A/B, and a plain read of
the same bytes as the bandwidth ceiling. Timed in C++ (benchmarks/kernels/gemv_micro.cpp, min over reps);
"cold" cycles through enough weight copies (>= 96 MB) to miss the 32 MB L3, "hot" reuses one.

    python -m benchmarks.kernels.gemv_micro [--shapes gate_up down ...] [--threads 1 2] [--rounds 3]

Shapes are SmolLM2-135M's (Q4_1: int4 group 32 with mins; lm_head: Q8_0), float16 scales.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch.utils import cpp_extension

# gemv_micro.cpp is AVX2 code built on its own (not part of llmctl's extension): these flags compile it
CFLAGS = ["-O3", "-g0", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]  # quant_kernels.cpp sets its targets
LDFLAGS = ["-fopenmp"]

SHAPES = {  # name: (N, K, int4)
    "qkv": (960, 576, True),
    "o": (576, 576, True),
    "gate_up": (3072, 576, True),
    "down": (576, 1536, True),
    "lm_head": (49152, 576, False),
}


def build():
    src = Path(__file__).with_name("gemv_micro.cpp")
    return cpp_extension.load(
        "llmctl_gemv_micro",
        [str(src)],
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        build_directory=_build_dir(),
        verbose=False,
    )


def _build_dir() -> str:
    path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmctl" / "gemv_micro"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def weights(n: int, k: int, int4: bool, group: int = 32):
    gen = torch.Generator().manual_seed(n * 7 + k)
    if int4:
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        mins = (torch.randn(n, k // group, generator=gen) * 0.05).half()
    else:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        mins = None
    scales = (torch.rand(n, k // group, generator=gen) * 0.02).half()
    return q, scales, mins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=400)
    parser.add_argument("--hot", action="store_true", help="one weight copy (cache-resident where it fits)")
    args = parser.parse_args()
    mod, quant = build(), None
    from llmctl_kernels.quant_native import load_quant_native

    quant = load_quant_native()
    print(f"load {os.getloadavg()}")
    for name in args.shapes:
        n, k, int4 = SHAPES[name]
        q, s, mn = weights(n, k, int4)
        tiles = quant.interleave_tiles(q, s, mn, 32)
        nbytes = q.numel() + s.numel() * 2 + (0 if mn is None else mn.numel() * 2)
        copies = 1 if args.hot else max(2, (96 << 20) // nbytes + 1)
        rows_w = [q.clone() for _ in range(copies)]
        rows_s = [s.clone() for _ in range(copies)]
        rows_m = [] if mn is None else [mn.clone() for _ in range(copies)]
        tile_w = [tiles.clone() for _ in range(copies)]
        flat = [torch.empty(nbytes, dtype=torch.uint8).fill_(1) for _ in range(copies)]
        x = torch.randn(1, k)
        ref = (quant.int4_linear if int4 else quant.int8_linear)(x, q, s, mn, 32, True)
        same = torch.equal(ref, quant.interleaved_linear(x, tiles, int4, n, 32, 2, mn is not None))
        print(
            f"\n{name}: N={n} K={k} {'Q4_1' if int4 else 'Q8_0'}, {nbytes / 1e6:.3f} MB, {copies} copies, "
            f"tiles == rows: {same}"
        )
        for threads in args.threads:
            torch.set_num_threads(threads)
            best = {"rows": 1e30, "tiles": 1e30, "read": 1e30}
            for _ in range(args.rounds):
                best["rows"] = min(best["rows"], mod.gemv_ns("rows", int4, x, rows_w, rows_s, rows_m, 32, n, args.reps))
                best["tiles"] = min(
                    best["tiles"], mod.gemv_ns("tiles", int4, x, tile_w, [s], rows_m[:1], 32, n, args.reps)
                )
                best["read"] = min(best["read"], mod.read_ns(flat, args.reps))
            qx = mod.quantize_ns(x, int4, args.reps)
            line = ", ".join(f"{key} {v / 1e3:7.1f} us ({nbytes / v:5.1f} GB/s)" for key, v in best.items())
            print(f"  {threads} thr: {line}; quantize_x {qx / 1e3:.2f} us; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
