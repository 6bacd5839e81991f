"""Where a decode step of a small model spends its time on a CPU: engine step wall time, the model
forward alone, and a torch.profiler breakdown of one forward by op (self CPU time).

usage: python -m benchmarks.features.step_profile [MODEL] [--batch N ...] [--dtype D] [--steps K] [--threads T]

MODEL is ``smollm2-random`` (default: SmolLM2-135M's shape -- 30 layers, hidden 576, 9 heads /
3 KV heads, intermediate 1536, vocab 49152 -- at random weights, built with transformers' LlamaConfig
into a temp folder), ``tiny-random-llama`` (the embedded model) or a model folder. Each batch runs
prompts of 128 tokens, then times K decode steps (median wall time) and K forwards of the last
step's batch (median wall time, and the least CPU time: on a machine shared with other work, CPU
time with --threads 1 is the figure that compares two versions fairly).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


def smollm2_random_dir() -> Path:
    folder = Path(tempfile.gettempdir()) / "llmctl-smollm2-random"
    if not (folder / "config.json").exists():
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_SHAPE), dtype=torch.float32)
        model.save_pretrained(folder)
    return folder


def decode_batch(engine: LLMEngine, batch: int, prompt_len: int = 128) -> None:
    """Queue ``batch`` requests and step until every one of them is decoding."""
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 1000 + 3 for j in range(prompt_len)], params)
    while (
        any(s.num_computed_tokens < len(s.token_ids) - 1 for s in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()


def profile(engine: LLMEngine, batch: int, steps: int) -> None:
    decode_batch(engine, batch)
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    # the forward alone, on the last step's batch
    runner, sched = engine.runner, engine.scheduler.schedule()
    forward, cpu = [], []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        runner.execute(sched)
        forward.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner.execute(sched)
    step_ms, fwd_ms = 1000 * statistics.median(walls), 1000 * statistics.median(forward)
    print(
        f"\n=== batch {batch}: engine step {step_ms:.2f} ms (median of {steps}), model forward + logits "
        f"{fwd_ms:.2f} ms (least CPU time {1000 * min(cpu):.2f} ms), rest of the step {step_ms - fwd_ms:.2f} ms"
    )
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    print(f"profiled forward: {total / 1000:.2f} ms self CPU over {sum(e.count for e in events)} op calls")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=44))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2-random")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quantization", default="auto", help="auto | none | int8 | int4 | fp8")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = str(smollm2_random_dir()) if args.model == "smollm2-random" else args.model
    try:
        from llmctl_kernels.cpu_features import cpu_model, isa_level
    except ImportError:  # a checkout from before kernels/cpu_features.py
        cpu_model, isa_level = (lambda: "?"), (lambda: "march=native")

    for batch in args.batch:
        engine = LLMEngine(
            model=model,
            dtype=args.dtype,
            skip_tokenizer=True,
            max_model_len=1024,
            max_num_seqs=max(batch, 1),
            kv_cache_memory=1 << 30,
            quantization=args.quantization,
        )
        print(
            f"{args.model} · {engine.dtype} · quantization {args.quantization} · {engine.ops.description} · "
            f"ISA {isa_level()} · {cpu_model()} · {torch.get_num_threads()} threads"
        )
        profile(engine, batch, args.steps)


if __name__ == "__main__":
    main()
