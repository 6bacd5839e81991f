"""Speculative decoding on a repetitive workload: tokens/s with and without it, same greedy output.

The workload is an edit: the model is asked to rewrite a given paragraph with a few corrections, so
most of its answer copies the prompt -- what n-gram prompt lookup (``--speculative-model ngram``)
drafts for free. Both engines run the same request, greedy, interleaved (A B A B ...) on one
machine; ``tok_s`` is output tokens / wall time of the whole request (median of ROUNDS), and the
token ids must be identical. Also records the acceptance rate, the CPU and the load average.

    python -m benchmarks.features.spec_decode [--model smollm2-135m] [--speculative-model ngram] \\
        [--num-speculative-tokens 4] [--tokens 256] [--rounds 5] [--threads N] [--out spec_decode.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness import cpu_record

TEXT = (
    "The river town of Ashford sits where two valleys meet. Every morning the baker opens his shop "
    "before sunrise, and the smell of fresh bread drifts along the main street. Children walk to the "
    "old stone school by the bridge, while farmers bring apples, cheese and honey to the market square. "
    "In the summer, visitors come to swim in the river and to climb the hills above the town. In the "
    "winter, the streets are quiet, the lamps are lit early, and people gather in the library to read "
    "and to talk about the year that has passed."
)
INSTRUCTION = 'Rewrite the following text exactly as it is, but replace the word "town" with "village":\n\n'


def chat_prompt(engine, text: str) -> list[int]:
    tokenizer = engine.tokenizer
    messages = [{"role": "user", "content": INSTRUCTION + text}]
    if not tokenizer.chat_template:  # a base model (stories260k) gets the plain instruction
        return tokenizer.encode(INSTRUCTION + text + "\n\n")
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def timed_run(engine, prompt: list[int], params) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    return out.outputs[0].token_ids, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--speculative-model", default="ngram")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="most output tokens (EOS ends a run earlier)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto", help="auto keeps a GGUF packed; none: float weights")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args()

    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.sampling_params import SamplingParams

    common = dict(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=4,
        kv_cache_memory=256 << 20,
        max_model_len=2048,
        num_threads=args.threads,
    )
    engines = {
        "plain": LLMEngine(**common),
        "spec": LLMEngine(
            **common, speculative_model=args.speculative_model, num_speculative_tokens=args.num_speculative_tokens
        ),
    }
    prompt = chat_prompt(engines["plain"], TEXT)
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    outputs, times = {}, {name: [] for name in engines}
    for engine in engines.values():
        timed_run(engine, prompt, params)  # warm-up
    load_before = os.getloadavg()[0]
    for _ in range(args.rounds):
        for name, engine in engines.items():
            outputs[name], seconds = timed_run(engine, prompt, params)
            times[name].append(seconds)
    load_after = os.getloadavg()[0]
    counters = engines["spec"].speculator.counters
    tokens = len(outputs["plain"])
    result = {
        "model": args.model,
        "dtype": str(engines["plain"].dtype),
        "quantization": args.quantization,
        "speculative_model": args.speculative_model,
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_tokens": len(prompt),
        "output_tokens": tokens,
        "identical_output": outputs["plain"] == outputs["spec"],
        "plain_tok_s": round(tokens / statistics.median(times["plain"]), 1),
        "spec_tok_s": round(tokens / statistics.median(times["spec"]), 1),
        "acceptance_rate": round(counters.acceptance_rate or 0.0, 3),
        "mean_accepted_length": round(counters.mean_accepted_length or 0.0, 2),
        "rounds": args.rounds,
        "load_avg_1m": [round(load_before, 2), round(load_after, 2)],
        "engine": engines["plain"].ops.description,
        **cpu_record(),
        "text": engines["plain"].tokenizer.decode(outputs["plain"]),
    }
    result["speedup"] = round(result["spec_tok_s"] / result["plain_tok_s"], 2)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "text"}))
    print(
        f"RESULT spec decode {args.speculative_model} k={args.num_speculative_tokens} on {args.model}: "
        f"{result['plain_tok_s']} -> {result['spec_tok_s']} tok/s ({result['speedup']}x), acceptance "
        f"{100 * result['acceptance_rate']:.1f}%, {result['mean_accepted_length']} tok/verify, identical output: "
        f"{result['identical_output']}; {result['cpu']} [{result['isa']}], load {result['load_avg_1m']}"
    )
    if not result["identical_output"]:
        sys.exit("greedy output differs with speculation")


if __name__ == "__main__":
    main()
