"""Decode attention over a quantized KV pool, one layer: the native CPU kernel against the torch
reference (gather + dequantize + SDPA), interleaved ABAB on the same pool.

    python -m benchmarks.kernels.kv_quant_decode_kernel            # SmolLM2-135M's attention shape

The pool holds random codes, scales and zeros (timing only); KIVI sequences have their last block
in the full-precision residual. Prints the median time per call of each path and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from benchmarks.harness import cpu_record
from llmctl.engine.kv_cache import KVFormat
from llmctl_kernels import kv_quant as kq
from llmctl_kernels.kv_quant_native import load_kv_quant_native, quantized_decode_attention_native


def random_pool(fmt: KVFormat, num_blocks: int, num_residual: int) -> tuple[dict, dict]:
    tensors = {}
    for name, (shape, dtype) in fmt.tensor_shapes().items():
        if dtype in (torch.float32, torch.float16):
            tensors[name] = (torch.rand(num_blocks, *shape) * 0.1).to(dtype)
        elif dtype == torch.int8:
            tensors[name] = torch.randint(-127, 128, (num_blocks, *shape), dtype=torch.int8)
        else:  # uint8 codes, fp8 through bytes
            raw = torch.randint(0, 256, (num_blocks, *shape), dtype=torch.uint8)
            tensors[name] = raw if dtype == torch.uint8 else (raw & 0x77).view(dtype)  # finite fp8 codes
    shape = (num_residual, fmt.block_size, fmt.num_kv_heads, fmt.head_dim)
    residual = {name: torch.randn(shape, dtype=fmt.model_dtype) for name in ("k", "v")}
    return tensors, residual


def reference(query, fmt, tensors, residual, table_of_slots, tables, lens, scale):
    """The reference's decode: kv_cache.QuantizedLayerKV.gather + llmctl_kernels.kv_quant.decode_attention_dense."""
    bs, max_len = fmt.block_size, int(lens.max())
    blocks = tables[:, : -(-max_len // bs)].long()
    t = tensors
    if fmt.is_kivi:
        keys = kq.dequantize_kivi_keys(t["k"][blocks], t["k_scale"][blocks], t["k_zero"][blocks], fmt.bits, query.dtype)
        values = kq.dequantize_kivi_values(
            t["v"][blocks], t["v_scale"][blocks], t["v_zero"][blocks], fmt.bits, fmt.value_group, query.dtype
        )
        slot = table_of_slots[blocks]
        is_open = (slot >= 0)[..., None, None, None]
        keys = torch.where(is_open, residual["k"][slot.clamp(min=0)], keys)
        values = torch.where(is_open, residual["v"][slot.clamp(min=0)], values)
    else:
        keys = kq.dequantize_per_token(t["k"][blocks], t["k_scale"][blocks], query.dtype)
        values = kq.dequantize_per_token(t["v"][blocks], t["v_scale"][blocks], query.dtype)
    shape = (len(lens), blocks.shape[1] * bs, fmt.num_kv_heads, fmt.head_dim)
    return kq.decode_attention_dense(
        query, keys.reshape(shape)[:, :max_len], values.reshape(shape)[:, :max_len], lens, scale
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="fp8_e4m3,fp8_e5m2,int8,kivi4,kivi2")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if load_kv_quant_native() is None:
        sys.exit("the native quantized-KV kernels are not available here")
    print(f"# {cpu_record()}, threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    print(
        f"# {args.seqs} sequences x {args.context} tokens, {args.q_heads}/{args.kv_heads} heads x {args.head_dim}, "
        f"block {args.block_size}, fp32 queries; median of {args.rounds} interleaved rounds"
    )
    print("| KV dtype | reference ms | native ms | speed-up |\n|---|---:|---:|---:|")
    bs, per_seq = args.block_size, -(-args.context // args.block_size)
    for kind in args.dtypes.split(","):
        fmt = KVFormat(kind, 1, args.kv_heads, args.head_dim, bs, torch.float32)
        tensors, residual = random_pool(fmt, args.seqs * per_seq, args.seqs)
        tables = torch.arange(args.seqs * per_seq, dtype=torch.int32).view(args.seqs, per_seq)
        slots = torch.full((args.seqs * per_seq,), -1, dtype=torch.int64)
        slots[tables[:, -1].long()] = torch.arange(args.seqs)  # each sequence's last block is open
        lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
        query = torch.randn(args.seqs, args.q_heads, args.head_dim)
        scale = args.head_dim**-0.5

        def run_native():
            return quantized_decode_attention_native(
                query,
                kind,
                tensors,
                tables,
                lens,
                scale,
                value_group=fmt.value_group,
                residual=residual,
                residual_table=slots,
            )

        def run_reference():
            return reference(query, fmt, tensors, residual, slots, tables, lens, scale)

        torch.testing.assert_close(run_native(), run_reference(), atol=1e-4, rtol=1e-3)
        times = {"reference": [], "native": []}
        for _ in range(args.rounds):
            for name, fn in (("reference", run_reference), ("native", run_native)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        ref, nat = (1000 * statistics.median(times[n]) for n in ("reference", "native"))
        print(f"| {kind} | {ref:.2f} | {nat:.2f} | {ref / nat:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
