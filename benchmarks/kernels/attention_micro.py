"""The native CPU attention kernels alone, on the 246M Llama's shapes (16 query / 4 KV heads of 64):
decode (``paged_decode_attention``: SEQS sequences of CONTEXT tokens in scattered blocks, fp32 or
bf16, best of 30 calls, with GB/s of KV read) and fp32 prefill (16 prompts of PROMPT tokens: the
native ``paged_prefill_attention`` against SDPA per sequence, as the engine ran it before).

    python -m benchmarks.kernels.attention_micro [--seqs 64] [--context 192] [--prompt 128] [--dtype float32]
        [--layers 1] [--heads 16,4]

``--layers N`` gives N separate caches and times a sweep over all of them, as a decode step visits
its layers: with N large enough the KV no longer fits in the last-level cache and the kernel reads
it from memory, as in the engine (one layer's 64 x 192 tokens, 25 MB, stays in a 32 MB L3). ``--heads``
sets the query / KV heads (9,3 for SmolLM2-135M).

``LLMCTL_CPU_ISA`` picks the variant (e.g. avx512 against avx512bf16 for bf16 decode). Compare
versions by running this script from two checkouts alternately; on a shared machine the figures move.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import best_of
from llmctl_kernels.cpu_native import paged_decode_attention_native, paged_prefill_attention_native
from llmctl_kernels.prefill_attention import attend_causal

HQ, HKV, D, BS = 16, 4, 64, 16


def scattered_cache(seqs: int, tokens: int, dtype: torch.dtype, kv_heads: int = HKV):
    per_seq = (tokens + BS - 1) // BS
    blocks = seqs * per_seq + 8
    k, v = (torch.randn(blocks, BS, kv_heads, D).to(dtype) for _ in range(2))
    tables = torch.randperm(blocks)[: seqs * per_seq].view(seqs, per_seq).to(torch.int32)
    return k, v, tables


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--heads", default=f"{HQ},{HKV}", help="query heads,KV heads")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    q_heads, kv_heads = (int(n) for n in args.heads.split(","))

    caches = [scattered_cache(args.seqs, args.context, dtype, kv_heads) for _ in range(args.layers)]
    lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    q = torch.randn(args.seqs, q_heads, D).to(dtype)

    def sweep() -> None:
        for k, v, tables in caches:
            paged_decode_attention_native(q, k, v, tables, lens, D**-0.5)

    took = best_of(sweep, max(3, 30 // args.layers), warmup=3) / args.layers
    kv_bytes = args.seqs * args.context * kv_heads * D * 2 * dtype.itemsize
    print(
        f"decode {args.dtype}, {args.seqs} x {args.context} tokens, {q_heads}/{kv_heads} heads, {args.layers} "
        f"layer(s), {torch.get_num_threads()} threads: {took * 1e3:.3f} ms a layer, "
        f"{kv_bytes / took / 1e9:.1f} GB/s of KV"
    )

    seqs, length = 16, args.prompt
    q = torch.randn(seqs * length, HQ, D)
    keys, values = torch.randn(seqs * length, HKV, D), torch.randn(seqs * length, HKV, D)
    k, v, tables = scattered_cache(seqs, length, torch.float32)
    for i in range(seqs):  # the prompt's K/V in the cache, as the engine stores them before attention
        for t in range(length):
            k[tables[i, t // BS], t % BS] = keys[i * length + t]
            v[tables[i, t // BS], t % BS] = values[i * length + t]
    starts = (torch.arange(seqs + 1) * length).to(torch.int32)
    lens = torch.full((seqs,), length, dtype=torch.int32)

    def sdpa_per_sequence() -> torch.Tensor:
        out = torch.empty_like(q)
        for i in range(seqs):
            s, e = i * length, (i + 1) * length
            out[s:e] = attend_causal(q[s:e], keys[s:e], values[s:e], D**-0.5)
        return out

    native = best_of(lambda: paged_prefill_attention_native(q, k, v, tables, starts, lens, D**-0.5), 10, warmup=3)
    sdpa = best_of(sdpa_per_sequence, 10, warmup=3)
    diff = (sdpa_per_sequence() - paged_prefill_attention_native(q, k, v, tables, starts, lens, D**-0.5)).abs().max()
    print(
        f"prefill fp32, {seqs} prompts x {length}: native {native * 1e3:.2f} ms, SDPA per sequence "
        f"{sdpa * 1e3:.2f} ms (max difference {diff:.2g})"
    )


if __name__ == "__main__":
    main()
