"""Where one decode step of a single stream goes: the engine's pieces in Python (scheduler, batch
tensors, the native layer loop, LM head, sampler, bookkeeping, detokenizing) and, inside the native
decode loop, each op summed over the layers. Wall time per step, median over steps.

    python -m benchmarks.features.decode_breakdown [MODEL] [--threads 1 2] [--tokens 120] [--quantization auto]
        [--concurrency 1] [--kv-cache-dtype auto] [--skip-tokenizer]

For each thread count: a warm-up request, then one request of TOKENS greedy tokens after a chat
prompt (the context grows from ~30 to ~30 + TOKENS), every step timed. ``--concurrency N``: N
requests of 128 random prompt ids each instead (distinct, so that no KV block is shared; the
batched-decode shape of ``llmctl bench --concurrency N``), their prefill steps not timed. On a
shared machine compare figures of one run only, and say what the load average was (printed).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

PROMPT = "<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n"


def timed(times: dict[str, list[float]], name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name].append(time.perf_counter() - start)

    return wrapper


def breakdown(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms per decode step of each engine piece, and mean ms per step of each native op, while
    ``prompts`` decode TOKENS tokens each (from the first step in which every one of them decodes)."""
    times: dict[str, list[float]] = defaultdict(list)
    runner, model = engine.runner, engine.runner.model
    patches = [
        (engine.scheduler, "schedule", "scheduler"),
        (runner, "prepare", "batch tensors"),
        (model, "compute_logits", "LM head"),
        (engine.sampler, "sample", "sampler"),
        (engine.scheduler, "update_from_output", "update"),
        (engine.output_processor, "process", "outputs+detok"),
        (engine.stats, "record_step", "stats"),
    ]
    if runner.native_decode is not None:
        patches.append((runner, "native_decode", "layers (native)"))
    else:
        patches.append((model, "forward", "layers (modules)"))  # the module itself stays: its methods are timed too
    loop = runner.native_decode.loop if runner.native_decode is not None else None
    originals = [(obj, attr, vars(obj).get(attr)) for obj, attr, _ in patches]
    for obj, attr, name in patches:
        setattr(obj, attr, timed(times, name, getattr(obj, attr)))
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    while any(seq.num_output_tokens == 0 for seq in engine.live_sequences()):
        engine.step()  # the prefill steps
    times.clear()
    if loop is not None:
        loop.set_profile(True)
    step_times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    for obj, attr, original in originals:  # an instance attribute back, or the class's method again
        setattr(obj, attr, original) if original is not None else delattr(obj, attr)
    pieces = {name: 1e3 * statistics.median(v) for name, v in times.items()}
    pieces["whole step"] = 1e3 * statistics.median(step_times)
    pieces["rest (not timed above)"] = pieces["whole step"] - sum(v for k, v in pieces.items() if k != "whole step")
    ops: dict[str, float] = {}
    if loop is not None:
        prof = loop.profile()
        loop.set_profile(False)
        steps = max(1, prof.pop("steps"))
        ops = {k: 1e3 * v / steps for k, v in prof.items()}
    return pieces, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--concurrency", type=int, default=1, help="requests decoding together")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument(
        "--skip-tokenizer",
        action="store_true",
        help="a model folder without tokenizer.json (the peer's llama250m); needs --concurrency > 1",
    )
    args = parser.parse_args()
    if args.skip_tokenizer and args.concurrency == 1:
        parser.error("--skip-tokenizer: the single stream starts from a chat prompt, which needs the tokenizer")
    engine = LLMEngine(
        model=args.model,
        quantization=args.quantization,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=max(4, args.concurrency),
        kv_cache_memory=max(256 << 20, args.concurrency << 25),
        max_model_len=1024,
        skip_tokenizer=args.skip_tokenizer,
    )
    print(
        f"{args.model}, quantization {args.quantization}, KV {args.kv_cache_dtype}, {engine.runner.decode_path}, "
        f"{args.concurrency} request(s); load {os.getloadavg()}"
    )
    if args.concurrency == 1:
        prompts = [engine.tokenizer.encode(PROMPT, add_special_tokens=False)]
    else:
        rng = random.Random(1234)
        vocab = engine.model.config.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(128)] for _ in range(args.concurrency + 1)]
    warm_up, prompts = prompts[-1:], prompts[: args.concurrency]  # concurrency 1: the chat prompt twice, as before
    for threads in args.threads:
        torch.set_num_threads(threads)
        engine.generate(warm_up, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        pieces, ops = breakdown(engine, prompts, args.tokens)
        print(f"\n{threads} thread(s), ms per decode step (median; native ops: mean), load {os.getloadavg()[0]:.2f}")
        for name, ms in pieces.items():
            print(f"  {name:24s} {ms:7.3f}")
        if ops:
            print(f"  native ops, sum {sum(ops.values()):.3f}:")
            for name, ms in ops.items():
                print(f"    {name:22s} {ms:7.3f}")


if __name__ == "__main__":
    main()
