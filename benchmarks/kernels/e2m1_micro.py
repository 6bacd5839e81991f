"""MXFP4's values as an int8 weight (gpt-oss's experts repacked): its tiles as 4-bit codes against
int8 tiles of the same values, one row of x (a decode step's expert GEMV, the int16 passes) or
several, on gpt-oss's expert shape (1,536 × 768, gate and up) stacked ``--copies`` times so that the
weight leaves the caches; the least wall time of ``--reps`` calls, interleaved, and the bytes and
weights a second it streams.

    .venv/bin/python -m benchmarks.kernels.e2m1_micro [--threads 2] [--copies 64] [--m 1] [--reps 10]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import best_of, cpu_line
from llmctl_kernels.quant_native import E2M1_TILES, INT8_TILES, load_quant_native

VALUES = [-12, -8, -6, -4, -3, -2, -1, 0, 1, 2, 3, 4, 6, 8, 12]  # MXFP4's, doubled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--copies", type=int, default=64, help="expert projections stacked (64: 75 M weights)")
    parser.add_argument("--m", type=int, default=1, help="rows of x")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = load_quant_native()
    n, k = 1536 * args.copies, 768
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor(VALUES, dtype=torch.int8)[torch.randint(0, len(VALUES), (n, k), generator=gen)]
    scales = torch.exp2(torch.randint(-9, -3, (n, k // 32), generator=gen).float())
    x = torch.randn(args.m, k, generator=gen)
    tiles = {
        "int8 tiles": (module.interleave_tiles(q, scales, None, 32), INT8_TILES),
        "E2M1 codes": (module.interleave_tiles(q, scales, None, 32, e2m1=True), E2M1_TILES),
    }
    outs = {name: module.interleaved_linear(x, t, kind, n, 32, 4, False) for name, (t, kind) in tiles.items()}
    print(f"# {cpu_line()}; {args.threads} thread(s), {n} x {k}, {args.m} row(s) of x")
    print(f"# the same bits: {torch.equal(*outs.values())}")
    best = dict.fromkeys(tiles, float("inf"))
    for _ in range(2):  # interleaved rounds
        for name, (t, kind) in tiles.items():
            seconds = best_of(lambda t=t, kind=kind: module.interleaved_linear(x, t, kind, n, 32, 4, False), args.reps)
            best[name] = min(best[name], seconds)
    for name, seconds in best.items():
        size = tiles[name][0].numel()
        print(
            f"{name:11s} {seconds * 1e3:8.3f} ms  {size / seconds / 1e9:5.1f} GB/s  "
            f"{n * k * args.m / seconds / 1e9:5.1f} G weights/s  ({size / (n * k):.2f} bytes a weight)"
        )


if __name__ == "__main__":
    main()
