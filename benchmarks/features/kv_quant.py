"""KV cache dtypes side by side at one ``--kv-cache-memory``: token slots, concurrent sequences,
output throughput at 64 concurrent requests, and perplexity on real English text.

    python -m benchmarks.features.kv_quant                       # smollm2-135m, 256 MiB of KV, every dtype
    python -m benchmarks.features.kv_quant --dtypes auto,kivi2 --skip-throughput

Token slots are what the engine actually allocates (pool blocks x block size, after KIVI's
full-precision residual slots, one per ``--max-num-seqs`` seat, were paid from the same budget).
"vs bf16" divides them by the slots a bfloat16 cache of the same model gets in the same memory.
Perplexity runs the engine's prompt-logprobs path, so every position reads K/V through the cache
(see llmctl/engine/kv_cache.py), windows of ``--window`` tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness import cpu_record
from llmctl.config import parse_size
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.model_runner import kv_format
from llmctl.perplexity import perplexity
from llmctl.sampling_params import SamplingParams

ALL = "auto,fp8_e4m3,fp8_e5m2,int8,kivi4,kivi2"


def throughput(engine: LLMEngine, concurrency: int, prompt_len: int, output_len: int) -> float:
    """Output tokens/s with ``concurrency`` requests queued at once (token-id prompts)."""
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, vocab, (prompt_len,), generator=gen).tolist() for _ in range(concurrency)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def throughputs(engine: LLMEngine, args: argparse.Namespace) -> dict:
    """Output tok/s at ``--concurrency``, best of ``--repeats``; with ``--compare-reference`` the
    native quantized-KV decode kernel and the torch reference alternate in one run (ABAB...), so a
    shared machine's load hits both alike."""
    kv = engine.runner.quantized_kv
    available = kv is not None and kv.native_decode
    modes = {"output_tok_s": True}
    if args.compare_reference and available:
        modes["output_tok_s_reference"] = False
    best = dict.fromkeys(modes, 0.0)
    for _ in range(args.repeats):
        for name, native in modes.items():
            if kv is not None:
                kv.native_decode = native and available
            best[name] = max(best[name], throughput(engine, args.concurrency, args.prompt_len, args.output_len))
    return best


def decode_step_ms(engine: LLMEngine, args: argparse.Namespace) -> dict:
    """Median wall time of one decode step of ``--concurrency`` sequences (prompts of
    ``--prompt-len``), ``--steps`` steps per mode and round, ``--repeats`` rounds; with
    ``--compare-reference`` the native kernel and the torch reference alternate (ABAB...)."""
    kv = engine.runner.quantized_kv
    available = kv is not None and kv.native_decode
    modes = {"decode_ms": True}
    if args.compare_reference and available:
        modes["decode_ms_reference"] = False
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    # room for every timed step however many tokens a sequence decoded while others were prefilling
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - args.prompt_len, ignore_eos=True)
    ids = [
        engine.add_request(torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist(), params)
        for _ in range(args.concurrency)
    ]
    for _ in range(1000):  # until every prompt is prefilled and each step is all decodes
        if len(engine.step()) == args.concurrency and engine.scheduler.num_waiting == 0:
            break
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.repeats):
        for name, native in modes.items():
            if kv is not None:
                kv.native_decode = native and available
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
    for request_id in ids:
        engine.abort(request_id)
    if kv is not None:
        kv.native_decode = available
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


def run(args: argparse.Namespace, kind: str) -> dict:
    engine = LLMEngine(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=kind,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_residual_length=args.kv_residual_length,
    )
    fmt, kv = engine.kv_format, engine.runner.quantized_kv
    slots = engine.block_manager.num_blocks * args.block_size
    bf16 = kv_format(engine.model, args.block_size, torch.bfloat16)
    bf16_slots = args.kv_cache_memory // bf16.block_bytes() * args.block_size
    row = {
        "kv_cache_dtype": kind,
        "bytes_per_token": fmt.bytes_per_token(),
        "token_slots": slots,
        "vs_bf16_slots": slots / bf16_slots,
        "seqs_at_len": slots // args.seq_len,
        "residual_slots": 0 if kv is None else kv.residual["k"].shape[1],
    }
    if not args.skip_throughput:
        row.update(decode_step_ms(engine, args) if args.decode_steps else throughputs(engine, args))
    if not args.skip_perplexity:
        ids = engine.tokenizer.encode(Path(args.text).read_text())
        result = perplexity(engine, ids, args.window, args.window - 1)
        row["perplexity"] = result.perplexity
        row["scored_tokens"] = result.scored_tokens
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default=ALL)
    parser.add_argument("--dtype", default="auto", help="model dtype (the residual window's dtype)")
    parser.add_argument("--kv-cache-memory", type=parse_size, default=parse_size("256MiB"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=1024, help="sequence length for 'concurrent sequences'")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--text", default=str(Path(__file__).parents[1] / "data" / "fables.txt"))
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--kv-residual-length", type=int, default=128, help="KIVI's full-precision window R")
    parser.add_argument("--repeats", type=int, default=1, help="throughput runs per mode; the best is kept")
    parser.add_argument(
        "--compare-reference",
        action="store_true",
        help="also time the torch reference decode over the quantized pool, interleaved",
    )
    parser.add_argument(
        "--decode-steps",
        action="store_true",
        help="time decode steps at --concurrency instead of whole requests (tok/s = seqs / step)",
    )
    parser.add_argument("--steps", type=int, default=4, help="decode steps per mode and round (--decode-steps)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-perplexity", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    info = {
        **cpu_record(),
        "threads": torch.get_num_threads(),
        "kv_cache_memory": args.kv_cache_memory,
        "model": args.model,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "kv_residual_length": args.kv_residual_length,
        "load_average": os.getloadavg(),
    }
    rows = []
    if not args.json:
        print(f"# {info}")
        print(
            f"| KV dtype | B/token | token slots | vs bf16 | seqs of {args.seq_len} | out tok/s @{args.concurrency} "
            "| perplexity | vs auto |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for kind in args.dtypes.split(","):
        rows.append(r := run(args, kind))
        if not args.json:  # one row at a time: a long run shows its progress
            base = rows[0] if rows[0]["kv_cache_dtype"] == "auto" else None
            ppl = r.get("perplexity")
            rel = f"{(ppl / base['perplexity'] - 1) * 100:+.2f} %" if ppl and base and base.get("perplexity") else "-"
            if "decode_ms" in r:  # decode steps: sequences per step / step time
                r["output_tok_s"] = args.concurrency / r["decode_ms"] * 1000
                if "decode_ms_reference" in r:
                    r["output_tok_s_reference"] = args.concurrency / r["decode_ms_reference"] * 1000
            ref_speed = f" (ref {r['output_tok_s_reference']:.1f})" if "output_tok_s_reference" in r else ""
            print(
                f"| {r['kv_cache_dtype']} | {r['bytes_per_token']:g} | {r['token_slots']:,} | "
                f"{r['vs_bf16_slots']:.2f}x | {r['seqs_at_len']} | {r.get('output_tok_s', float('nan')):.1f}"
                f"{ref_speed} | "
                f"{'-' if ppl is None else round(ppl, 3)} | {rel} |",
                flush=True,
            )
    if args.json:
        print(json.dumps({"info": info, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
