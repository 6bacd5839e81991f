"""Microbenchmarks of llmctl's Triton kernels against their torch references (and SDPA).

On a CUDA machine::

    TRITON_INTERPRET=0 python3 -m benchmarks.kernels.gpu_kernels [--json results.json]

prints one table: decode attention's achieved bandwidth against the device's peak (Llama-8B-like
heads, batch 64 x 2,048 context, bf16), a long-context split-K case, prefill attention against
``torch.nn.functional.scaled_dot_product_attention``, the memory-bound elementwise kernels, and
one decoder layer's decode step built from the kernels (no engine needed), torch vs Triton.

``--dry-run`` runs every benchmark once at tiny shapes (on a CPU under Triton's interpreter) to
check the script itself; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Vendor datasheet peaks (GB/s) by device-name fragment, most specific first.
PEAK_BANDWIDTH_GBS = [
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),
    ("H800", 3350.0),
    ("GH200", 4000.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
]
PEAK_BF16_TFLOPS = [("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0)]


@dataclass
class Row:
    section: str
    name: str
    shape: str
    ms: float
    achieved: float | None = None  # GB/s or TFLOP/s
    unit: str = ""
    of_peak: float | None = None  # fraction of the relevant peak
    vs_ref: float | None = None  # speed-up over the row's reference
    note: str = ""


class Bench:
    def __init__(self, device, dry_run: bool, warmup_ms: int, rep_ms: int) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.dry = dry_run
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.rows: list[Row] = []
        self.peak_bw = None
        self.peak_tflops = None
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            self.peak_bw = next((bw for frag, bw in PEAK_BANDWIDTH_GBS if frag in name), None)
            self.peak_tflops = next((tf for frag, tf in PEAK_BF16_TFLOPS if frag in name), None)

    def time_ms(self, fn) -> float:
        if self.dry:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        from triton.testing import do_bench

        result = do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms)  # L2 flushed between runs
        return float(result[0] if isinstance(result, (tuple, list)) else result)

    def add_bw(self, section, name, shape, ms, nbytes, ref_ms=None, note="", peak_bw=None) -> Row:
        gbs = nbytes / (ms * 1e-3) / 1e9
        peak = peak_bw or self.peak_bw
        row = Row(
            section, name, shape, ms, gbs, "GB/s", gbs / peak if peak else None, (ref_ms / ms) if ref_ms else None, note
        )
        self.rows.append(row)
        return row

    def add_flops(self, section, name, shape, ms, flops, ref_ms=None, note="") -> Row:
        tflops = flops / (ms * 1e-3) / 1e12
        row = Row(
            section,
            name,
            shape,
            ms,
            tflops,
            "TFLOP/s",
            tflops / self.peak_tflops if self.peak_tflops else None,
            (ref_ms / ms) if ref_ms else None,
            note,
        )
        self.rows.append(row)
        return row

    def add_time(self, section, name, shape, ms, ref_ms=None, note="") -> Row:
        row = Row(section, name, shape, ms, vs_ref=(ref_ms / ms) if ref_ms else None, note=note)
        self.rows.append(row)
        return row


def max_err(a, b) -> str:
    return f"max|err|={(a.float() - b.float()).abs().max().item():.2e}"


def paged_cache(torch, batch, ctx, num_kv_heads, head_dim, block_size, dtype, device, gen):
    """K/V pools holding ``batch`` sequences of ``ctx`` tokens in shuffled blocks."""
    blocks_per_seq = math.ceil(ctx / block_size)
    num_blocks = batch * blocks_per_seq + 1
    perm = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
    tables = perm.view(batch, blocks_per_seq).to(torch.int32).to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    return key_cache, value_cache, tables


# --------------------------------------------------------------------------------------------- benchmarks


def bench_bandwidth(b: Bench) -> None:
    torch = b.torch
    n = (1 << 16) if b.dry else (1 << 30)  # bytes per buffer (1 GiB: far past the L2)
    src = torch.empty(n // 4, dtype=torch.float32, device=b.device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = b.time_ms(lambda: dst.copy_(src))
    row = b.add_bw(
        "memory", "device copy (read+write)", f"{n >> 20} MiB", ms, 2 * n, note="measured ceiling" if not b.dry else ""
    )
    if b.device.type == "cuda":
        b.copy_bw = row.achieved
    else:
        b.copy_bw = None


def bench_decode(b: Bench, cfg) -> None:
    torch = b.torch
    from llmctl_kernels._triton_utils import num_sms
    from llmctl_kernels.decode_attention import (
        decode_num_splits,
        paged_decode_attention_torch,
        paged_decode_attention_triton,
    )

    gen = torch.Generator().manual_seed(0)
    for batch, ctx in cfg["decode_cases"]:
        hq, hkv, d, bs, dtype = cfg["hq"], cfg["hkv"], cfg["d"], cfg["block_size"], cfg["dtype"]
        key_cache, value_cache, tables = paged_cache(torch, batch, ctx, hkv, d, bs, dtype, b.device, gen)
        query = torch.randn(batch, hq, d, dtype=dtype, device=b.device)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=b.device)
        scale = d**-0.5
        shape = f"B{batch} ctx{ctx} {hq}q/{hkv}kv D{d} {str(dtype)[6:]}"
        elem = torch.finfo(dtype).bits // 8
        nbytes = 2 * batch * ctx * hkv * d * elem + 2 * batch * hq * d * elem + tables.numel() * 4

        ref_out = paged_decode_attention_torch(query, key_cache, value_cache, tables, lens, scale)
        ref_ms = b.time_ms(lambda: paged_decode_attention_torch(query, key_cache, value_cache, tables, lens, scale))
        b.add_bw("decode", "torch reference (gather+SDPA)", shape, ref_ms, nbytes)

        auto = decode_num_splits(batch, hkv, ctx, num_sms(b.device))
        variants = [("auto", None)] + [(str(s), s) for s in cfg["forced_splits"] if s != auto]
        for _label, splits in variants:

            def run(splits=splits):
                return paged_decode_attention_triton(
                    query, key_cache, value_cache, tables, lens, scale, max_seq_len=ctx, num_splits=splits
                )

            out = run()
            ms = b.time_ms(run)
            name = f"triton splits={auto} (auto)" if splits is None else f"triton splits={splits}"
            b.add_bw("decode", name, shape, ms, nbytes, ref_ms=ref_ms, note=max_err(out, ref_out))


def bench_prefill(b: Bench, cfg) -> None:
    torch = b.torch
    import torch.nn.functional as F

    from llmctl_kernels.prefill_attention import paged_prefill_attention_triton, varlen_causal_attention_triton

    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, bs, dtype = cfg["hq"], cfg["hkv"], cfg["d"], cfg["block_size"], cfg["dtype"]
    scale = d**-0.5

    # fresh prompts: B sequences of L tokens
    batch, length = cfg["prefill_case"]
    shape = f"B{batch} L{length} {hq}q/{hkv}kv D{d} {str(dtype)[6:]}"
    flops = 4 * batch * hq * d * (length * (length + 1) / 2)  # QK^T and PV over the causal half
    q = torch.randn(batch, length, hq, d, dtype=dtype, device=b.device)
    k = torch.randn(batch, length, hkv, d, dtype=dtype, device=b.device)
    v = torch.randn(batch, length, hkv, d, dtype=dtype, device=b.device)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    k_rep = kt.repeat_interleave(hq // hkv, dim=1).contiguous()
    v_rep = vt.repeat_interleave(hq // hkv, dim=1).contiguous()
    qt = qt.contiguous()

    def sdpa_expanded():
        return F.scaled_dot_product_attention(qt, k_rep, v_rep, is_causal=True, scale=scale)

    def sdpa_gqa():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)

    ref = sdpa_expanded().transpose(1, 2).reshape(batch * length, hq, d)
    ref_ms = b.time_ms(sdpa_expanded)
    b.add_flops("prefill", "torch SDPA (K/V pre-expanded)", shape, ref_ms, flops)
    try:
        gqa_ms = b.time_ms(sdpa_gqa)
        b.add_flops("prefill", "torch SDPA (enable_gqa)", shape, gqa_ms, flops)
    except RuntimeError as exc:  # some backends refuse enable_gqa
        b.add_time("prefill", "torch SDPA (enable_gqa)", shape, float("nan"), note=f"failed: {exc}"[:60])

    qf = q.reshape(batch * length, hq, d)
    kf = k.reshape(batch * length, hkv, d)
    vf = v.reshape(batch * length, hkv, d)
    qsl = torch.arange(0, batch + 1, dtype=torch.int32, device=b.device) * length

    def varlen():
        return varlen_causal_attention_triton(qf, kf, vf, qsl, scale, max_query_len=length)

    out = varlen()
    ms = b.time_ms(varlen)
    b.add_flops(
        "prefill", "triton varlen (fresh, contiguous K/V)", shape, ms, flops, ref_ms=ref_ms, note=max_err(out, ref)
    )

    # the same prompts read through the paged cache
    key_cache, value_cache, tables = paged_cache(torch, batch, length, hkv, d, bs, dtype, b.device, gen)
    flat_k = key_cache.view(-1, hkv, d)
    flat_v = value_cache.view(-1, hkv, d)
    pos = torch.arange(length, device=b.device)
    slots = (tables.long()[:, pos // bs] * bs + pos % bs).reshape(-1)
    flat_k[slots] = kf
    flat_v[slots] = vf
    lens = torch.full((batch,), length, dtype=torch.int32, device=b.device)

    def paged():
        return paged_prefill_attention_triton(
            qf, key_cache, value_cache, tables, qsl, lens, scale, max_query_len=length
        )

    out = paged()
    ms = b.time_ms(paged)
    b.add_flops("prefill", "triton paged (block-table gather)", shape, ms, flops, ref_ms=ref_ms, note=max_err(out, ref))

    # extend: short chunks over long cached prefixes (chunked prefill / prefix-cache hits)
    batch, ctx, chunk = cfg["extend_case"]
    total = ctx + chunk
    key_cache, value_cache, tables = paged_cache(torch, batch, total, hkv, d, bs, dtype, b.device, gen)
    q = torch.randn(batch * chunk, hq, d, dtype=dtype, device=b.device)
    qsl = torch.arange(0, batch + 1, dtype=torch.int32, device=b.device) * chunk
    lens = torch.full((batch,), total, dtype=torch.int32, device=b.device)
    flops = 4 * batch * hq * d * (chunk * ctx + chunk * (chunk + 1) / 2)
    shape = f"B{batch} ctx{ctx}+{chunk} {hq}q/{hkv}kv D{d}"

    def extend():
        return paged_prefill_attention_triton(q, key_cache, value_cache, tables, qsl, lens, scale, max_query_len=chunk)

    ms = b.time_ms(extend)
    b.add_flops("prefill", "triton paged extend", shape, ms, flops)


def bench_elementwise(b: Bench, cfg) -> None:
    torch = b.torch
    from llmctl_kernels.activation import silu_and_mul_torch, silu_and_mul_triton
    from llmctl_kernels.kv_store import reshape_and_cache_torch, reshape_and_cache_triton
    from llmctl_kernels.rms_norm import rms_norm_torch, rms_norm_triton
    from llmctl_kernels.rotary import rotary_embedding_torch, rotary_embedding_triton

    dtype, tokens, hidden, inter = cfg["dtype"], cfg["tokens"], cfg["hidden"], cfg["intermediate"]
    hq, hkv, d = cfg["hq"], cfg["hkv"], cfg["d"]
    elem = torch.finfo(dtype).bits // 8
    dev = b.device

    x = torch.randn(tokens, hidden, dtype=dtype, device=dev)
    res = torch.randn_like(x)
    w = torch.randn(hidden, dtype=dtype, device=dev)
    nbytes = 5 * tokens * hidden * elem
    shape = f"T{tokens} H{hidden}"
    ref_ms = b.time_ms(lambda: rms_norm_torch(x, w, 1e-5, res))
    ms = b.time_ms(lambda: rms_norm_triton(x, w, 1e-5, res))
    b.add_bw("elementwise", "rms_norm+residual torch", shape, ref_ms, nbytes)
    b.add_bw(
        "elementwise",
        "rms_norm+residual triton",
        shape,
        ms,
        nbytes,
        ref_ms=ref_ms,
        note=max_err(rms_norm_triton(x, w, 1e-5, res)[0], rms_norm_torch(x, w, 1e-5, res)[0]),
    )

    gu = torch.randn(tokens, 2 * inter, dtype=dtype, device=dev)
    nbytes = 3 * tokens * inter * elem
    shape = f"T{tokens} I{inter}"
    ref_ms = b.time_ms(lambda: silu_and_mul_torch(gu))
    ms = b.time_ms(lambda: silu_and_mul_triton(gu))
    b.add_bw("elementwise", "silu_and_mul torch", shape, ref_ms, nbytes)
    b.add_bw("elementwise", "silu_and_mul triton", shape, ms, nbytes, ref_ms=ref_ms)

    q = torch.randn(tokens, hq, d, dtype=dtype, device=dev)
    k = torch.randn(tokens, hkv, d, dtype=dtype, device=dev)
    pos = torch.randint(0, 4096, (tokens,), device=dev)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev).float() / d))
    freqs = torch.outer(torch.arange(4096, device=dev).float(), inv)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1)
    nbytes = 2 * tokens * (hq + hkv) * d * elem + tokens * d * 4
    shape = f"T{tokens} {hq}q/{hkv}kv D{d}"
    ref_ms = b.time_ms(lambda: rotary_embedding_torch(pos, q, k, cos_sin))
    ms = b.time_ms(lambda: rotary_embedding_triton(pos, q, k, cos_sin))
    b.add_bw("elementwise", "rotary torch", shape, ref_ms, nbytes)
    b.add_bw("elementwise", "rotary triton", shape, ms, nbytes, ref_ms=ref_ms)

    bs = cfg["block_size"]
    num_blocks = math.ceil(tokens / bs) + 1
    kc = torch.zeros(num_blocks, bs, hkv, d, dtype=dtype, device=dev)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(num_blocks * bs, device=dev)[:tokens]
    kv_k = torch.randn(tokens, hkv, d, dtype=dtype, device=dev)
    kv_v = torch.randn_like(kv_k)
    nbytes = 4 * tokens * hkv * d * elem
    shape = f"T{tokens} {hkv}kv D{d}"
    ref_ms = b.time_ms(lambda: reshape_and_cache_torch(kv_k, kv_v, kc, vc, slots))
    ms = b.time_ms(lambda: reshape_and_cache_triton(kv_k, kv_v, kc, vc, slots))
    b.add_bw("elementwise", "reshape_and_cache torch", shape, ref_ms, nbytes)
    b.add_bw("elementwise", "reshape_and_cache triton", shape, ms, nbytes, ref_ms=ref_ms)


def bench_decode_layer(b: Bench, cfg) -> None:
    """One Llama-style decoder layer's decode step (eager), every fused op from one kernel set."""
    torch = b.torch
    from llmctl_kernels import activation, decode_attention, kv_store, rms_norm, rotary

    sets = {
        "torch": (
            rms_norm.rms_norm_torch,
            rotary.rotary_embedding_torch,
            kv_store.reshape_and_cache_torch,
            decode_attention.paged_decode_attention_torch,
            activation.silu_and_mul_torch,
        ),
        "triton": (
            rms_norm.rms_norm_triton,
            rotary.rotary_embedding_triton,
            kv_store.reshape_and_cache_triton,
            decode_attention.paged_decode_attention_triton,
            activation.silu_and_mul_triton,
        ),
    }
    dtype, hidden, inter = cfg["dtype"], cfg["hidden"], cfg["intermediate"]
    hq, hkv, d, bs = cfg["hq"], cfg["hkv"], cfg["d"], cfg["block_size"]
    batch, ctx = cfg["decode_cases"][0]
    dev = b.device
    gen = torch.Generator().manual_seed(2)
    key_cache, value_cache, tables = paged_cache(torch, batch, ctx, hkv, d, bs, dtype, dev, gen)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    positions = lens.long() - 1
    slots = tables.long()[torch.arange(batch, device=dev), positions // bs] * bs + positions % bs
    std = hidden**-0.5
    w_qkv = torch.randn((hq + 2 * hkv) * d, hidden, dtype=dtype, device=dev) * std
    w_o = torch.randn(hidden, hq * d, dtype=dtype, device=dev) * std
    w_gu = torch.randn(2 * inter, hidden, dtype=dtype, device=dev) * std
    w_down = torch.randn(hidden, inter, dtype=dtype, device=dev) * inter**-0.5
    n1 = torch.ones(hidden, dtype=dtype, device=dev)
    n2 = torch.ones(hidden, dtype=dtype, device=dev)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev).float() / d))
    freqs = torch.outer(torch.arange(ctx + 1, device=dev).float(), inv)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1)
    hidden_in = torch.randn(batch, hidden, dtype=dtype, device=dev)
    residual_in = torch.randn(batch, hidden, dtype=dtype, device=dev)

    def layer(kset):
        norm, rope, store, attend, act = kset
        x, res = norm(hidden_in, n1, 1e-5, residual_in)
        qkv = x @ w_qkv.t()
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k = rope(positions, q.view(batch, hq, d), k.view(batch, hkv, d), cos_sin)
        store(k, v.view(batch, hkv, d), key_cache, value_cache, slots)
        attn = attend(q, key_cache, value_cache, tables, lens, d**-0.5)
        x = attn.reshape(batch, hq * d) @ w_o.t()
        x, res = norm(x, n2, 1e-5, res)
        x = act(x @ w_gu.t()) @ w_down.t()
        return x, res

    shape = f"B{batch} ctx{ctx} H{hidden} I{inter} {hq}q/{hkv}kv"
    out_ref = layer(sets["torch"])[0]
    ref_ms = b.time_ms(lambda: layer(sets["torch"]))
    b.add_time("layer", "decode step, torch kernels", shape, ref_ms)
    out = layer(sets["triton"])[0]
    ms = b.time_ms(lambda: layer(sets["triton"]))
    b.add_time("layer", "decode step, triton kernels", shape, ms, ref_ms=ref_ms, note=max_err(out, out_ref))


# ------------------------------------------------------------------------------------------------ driver


def config(torch, dry: bool) -> dict:
    if dry:
        return dict(
            dtype=torch.bfloat16,
            hq=4,
            hkv=2,
            d=32,
            block_size=16,
            decode_cases=[(2, 40), (1, 300)],
            forced_splits=[1, 3],
            prefill_case=(2, 24),
            extend_case=(2, 40, 8),
            tokens=4,
            hidden=64,
            intermediate=96,
        )
    return dict(
        dtype=torch.bfloat16,
        hq=32,
        hkv=8,
        d=128,
        block_size=16,
        decode_cases=[(64, 2048), (4, 32768), (1, 131072)],
        forced_splits=[1, 4, 8, 32],
        prefill_case=(4, 2048),
        extend_case=(4, 4096, 512),
        tokens=8192,
        hidden=4096,
        intermediate=14336,
    )


def print_table(rows: list[Row], header: str) -> None:
    print(header)
    cols = ["section", "kernel", "shape", "time (us)", "achieved", "of peak", "vs torch", "note"]
    table = []
    for r in rows:
        table.append(
            [
                r.section,
                r.name,
                r.shape,
                f"{r.ms * 1e3:,.1f}" if r.ms == r.ms else "-",
                f"{r.achieved:,.1f} {r.unit}" if r.achieved is not None else "",
                f"{100 * r.of_peak:.1f}%" if r.of_peak is not None else "",
                f"{r.vs_ref:.2f}x" if r.vs_ref is not None else "",
                r.note,
            ]
        )
    widths = [max(len(c), *(len(row[i]) for row in table)) if table else len(c) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    print(line)
    print("-" * len(line))
    last = None
    for row in table:
        if last is not None and row[0] != last:
            print()
        last = row[0]
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, one run each (CPU interpreter ok)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu (dry run only)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--only", default=None, help="comma list of sections: memory,decode,prefill,elementwise,layer")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time per measurement")
    args = parser.parse_args()

    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.dry_run:
        print("no CUDA device: run with --dry-run to check the script on a CPU", file=sys.stderr)
        return 2
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: unset it (or set 0) to benchmark compiled kernels", file=sys.stderr)
        return 2
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    import triton

    b = Bench(device, args.dry_run, warmup_ms=25, rep_ms=args.rep_ms)
    cfg = config(torch, args.dry_run)
    sections = {
        "memory": bench_bandwidth,
        "decode": lambda b: bench_decode(b, cfg),
        "prefill": lambda b: bench_prefill(b, cfg),
        "elementwise": lambda b: bench_elementwise(b, cfg),
        "layer": lambda b: bench_decode_layer(b, cfg),
    }
    wanted = args.only.split(",") if args.only else list(sections)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info = (
            f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
            f"torch {torch.__version__}, triton {triton.__version__}; "
            f"peak bandwidth (datasheet) {b.peak_bw or '?'} GB/s, bf16 {b.peak_tflops or '?'} TFLOP/s"
        )
    else:
        info = (
            "CPU dry run under Triton's interpreter (timings meaningless); "
            f"torch {torch.__version__}, triton {triton.__version__}"
        )
    print(f"== llmctl kernel benchmarks: {info}", flush=True)

    failures = 0
    for name in wanted:
        start = time.perf_counter()
        print(f"-- {name} ...", flush=True)
        try:
            sections[name](b)
        except Exception as exc:  # noqa: BLE001 - keep going: one broken section must not hide the others
            failures += 1
            print(f"!! section {name} failed: {type(exc).__name__}: {exc}", flush=True)
        print(f"   done in {time.perf_counter() - start:.1f}s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print()
    copy_bw = getattr(b, "copy_bw", None)
    header = "== results" + (
        f" (measured copy bandwidth {copy_bw:,.0f} GB/s"
        + (f" = {100 * copy_bw / b.peak_bw:.0f}% of datasheet peak)" if b.peak_bw else ")")
        if copy_bw
        else ""
    )
    print_table(b.rows, header)
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "rows": [asdict(r) for r in b.rows]}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
