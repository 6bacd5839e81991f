"""KV memory of a long sequence with sliding-window KV-cache groups vs all-global attention.

A model of Gemma 3 1B's attention shape -- 26 layers, 5 local (window 512) to 1 global, 1 KV
head of 256 channels, bf16 KV, 32k positions -- with **random weights** and a scaled-down hidden
size, MLP and vocabulary (they change no KV byte), built twice: with its sliding windows, and with
every layer global. For each context length the engine's own scheduler and block manager run a
request through chunked prefill and a few decodes (the engine's ``schedule`` / ``update_from_output``; the forward
pass is skipped, ``--forward`` runs it) and the blocks each KV-cache group holds are read from the
block tables: bytes = blocks held x the pool's bytes per block (a block holds one group's layers).
Then the same ``--kv-cache-memory`` gets as many long requests as it admits at once.

usage: python -m benchmarks.features.sliding_window_memory [--lengths 8192 32768] [--kv-cache-memory 4GiB]
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import cpu_line, write_result
from llmctl.config import parse_size
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.sequence import FinishReason, Sequence
from llmctl.sampling_params import SamplingParams

LAYERS, WINDOW, PATTERN = 26, 512, 6  # Gemma 3 1B: sliding_window 512, every 6th layer global


def make_model(out_dir: Path, sliding: bool, max_len: int) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    kinds = ["full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(LAYERS)]
    config = Gemma3TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=WINDOW,
        layer_types=kinds if sliding else ["full_attention"] * LAYERS,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


def engine_for(model_dir: Path, args: argparse.Namespace, max_len: int) -> LLMEngine:
    return LLMEngine(
        model=str(model_dir),
        skip_tokenizer=True,
        dtype="bfloat16",
        kv_cache_memory=parse_size(args.kv_cache_memory),
        block_size=args.block_size,
        max_num_batched_tokens=args.chunk,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_len,
        enable_prefix_caching=False,
    )


def step(engine: LLMEngine, forward: bool) -> None:
    """One engine step on the scheduler's accounting: schedule, (run the model,) book one token per
    sampling sequence (token 1: the tokens do not change what is held)."""
    sched = engine.scheduler.schedule()
    if forward and not sched.is_empty:
        engine.runner.execute(sched)
    engine.scheduler.update_from_output(sched, [1] * len(sched.sampling))
    engine.block_manager.check_invariants(engine.scheduler.running)


def held_bytes(engine: LLMEngine, seq: Sequence) -> tuple[int, list[int]]:
    bm = engine.block_manager
    per_group = [bm.held_blocks(seq, g) for g in range(bm.num_groups)]
    return sum(per_group) * engine.pool_format.block_bytes(), per_group


def one_sequence(engine: LLMEngine, length: int, forward: bool) -> dict:
    """A prompt of ``length`` tokens, then decodes: what its groups hold while it decodes at
    ``length`` tokens (after its first decode step), and at most while its prompt is prefilled."""
    seq = Sequence("r", [7] * length, length, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.scheduler.add(seq)
    peak, decoding = 0, None
    while not seq.is_finished:
        step(engine, forward)
        if seq.is_finished:
            break
        total, per_group = held_bytes(engine, seq)
        if seq.num_output_tokens <= 1:
            peak = max(peak, total)
        elif decoding is None:
            decoding = (total, per_group)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks not all returned"
    return {"bytes_decoding": decoding[0], "blocks_per_group": decoding[1], "peak_prefill_bytes": peak}


def concurrent(engine: LLMEngine, length: int, requests: int, chunk: int) -> int:
    """Most sequences of ``length`` tokens with their prompt computed, resident at once, when
    ``requests`` of them arrive together and decode on while the others are prefilled."""
    steps = requests * (-(-length // chunk) + 1) + 8
    seqs = [
        Sequence(f"c{i}", [7 + i] * length, length, SamplingParams(max_tokens=steps, ignore_eos=True))
        for i in range(requests)
    ]
    for seq in seqs:
        engine.scheduler.add(seq)
    best = 0
    for _ in range(steps):
        step(engine, False)
        best = max(best, sum(s.num_computed_tokens >= length for s in engine.scheduler.running))
    for seq in seqs:
        if not seq.is_finished:
            engine.scheduler.finish(seq, FinishReason.ABORT)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--kv-cache-memory", default="4GiB")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=2048, help="--max-num-batched-tokens")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--requests", type=int, default=32, help="long requests offered at once (concurrency)")
    parser.add_argument("--forward", action="store_true", help="also run the model (slow on a CPU)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    # room for the concurrency run's decodes (its sequences decode while the others prefill)
    max_len = max(args.lengths) + args.requests * (max(args.lengths) // args.chunk + 2) + 64
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {kind: make_model(Path(tmp) / kind, kind == "sliding", max_len) for kind in ("sliding", "global")}
        engines = {kind: engine_for(d, args, max_len) for kind, d in dirs.items()}
        for length in args.lengths:
            row = {"tokens": length}
            for kind, engine in engines.items():
                row[kind] = one_sequence(engine, length, args.forward)
                row[kind]["concurrent"] = concurrent(engine, length, args.requests, args.chunk)
            rows.append(row)
        info = {
            kind: {
                "groups": [(g.window, len(g.layers)) for g in e.kv_groups],
                "num_blocks": e.block_manager.num_blocks,
                "block_bytes": e.pool_format.block_bytes(),
            }
            for kind, e in engines.items()
        }
    print(f"# {datetime.date.today()} {cpu_line()}")
    print(
        f"# Gemma 3 1B KV shape: {LAYERS} layers (every {PATTERN}th global), window {WINDOW}, 1 KV head x 256, "
        f"bf16; --kv-cache-memory {args.kv_cache_memory}, --block-size {args.block_size}, chunk {args.chunk}"
    )
    for kind, i in info.items():
        print(f"# {kind}: groups (window, layers) {i['groups']}, {i['num_blocks']} blocks of {i['block_bytes']} B")
    mib = 2**20
    print(
        "| tokens | all-global: KV held | sliding: KV held (blocks: full group + sliding groups) | ratio "
        f"| sliding: peak while prefilling | {args.requests} requests at once: resident, global / sliding |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        g, s = row["global"], row["sliding"]
        blocks = f"{s['blocks_per_group'][0]} + {'/'.join(map(str, s['blocks_per_group'][1:]))}"
        print(
            f"| {row['tokens']:,} | {g['bytes_decoding'] / mib:,.1f} MiB | {s['bytes_decoding'] / mib:,.1f} MiB "
            f"({blocks}) | {g['bytes_decoding'] / s['bytes_decoding']:.2f}x | {s['peak_prefill_bytes'] / mib:,.1f} MiB "
            f"| {g['concurrent']} / {s['concurrent']} |"
        )
    write_result({"rows": rows, "engines": info, "kv_cache_memory": args.kv_cache_memory}, args.json)


if __name__ == "__main__":
    main()
