"""Prefix caching and chunked prefill, each side by side with the feature off, in one run.

1. TTFT with a shared system prompt (default 1,000 tokens): requests arrive one after another,
   each = system prompt + a short question; prefix caching on vs off.
2. Decode inter-token latency while long prompts keep arriving: decode streams run while a long
   prompt arrives every few steps; chunked prefill on vs off (P50/P99 ITL of the decode streams).
3. Prefix hit rate of a multi-user shared-prefix workload.

usage: python -m benchmarks.features.prefix_and_chunking [--model DIR|tiny-random-llama] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def make_engine(args, **overrides) -> LLMEngine:
    kw = dict(
        model=args.model,
        dtype=args.dtype,
        skip_tokenizer=True,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=4096,
    )
    kw.update(overrides)
    return LLMEngine(**kw)


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def ttft_shared_system_prompt(args, caching: bool) -> dict:
    engine = make_engine(args, enable_prefix_caching=caching)
    vocab = engine.model.config.vocab_size
    rng = random.Random(0)
    system = random_ids(rng, args.system_len, vocab)
    engine.generate([random_ids(rng, 8, vocab)], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    ttfts = []
    for _ in range(args.num_requests):
        prompt = system + random_ids(rng, 32, vocab)
        (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        ttfts.append(out.metrics.ttft)
    sched = engine.scheduler
    steady = ttfts[1:]  # the first request fills the cache
    return {
        "prefix_caching": caching,
        "ttft_mean_ms": 1000 * statistics.mean(steady),
        "ttft_p50_ms": 1000 * percentile(steady, 50),
        "ttft_p99_ms": 1000 * percentile(steady, 99),
        "first_request_ttft_ms": 1000 * ttfts[0],
        "hit_rate": sched.prefix_hit_tokens / max(1, sched.prefix_query_tokens),
    }


def itl_with_long_prompts(args, chunked: bool) -> dict:
    engine = make_engine(
        args, enable_chunked_prefill=chunked, enable_prefix_caching=False, max_num_batched_tokens=args.chunk_budget
    )
    vocab = engine.model.config.vocab_size
    rng = random.Random(1)
    engine.generate([random_ids(rng, 8, vocab)], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    streams = {
        engine.add_request(
            random_ids(rng, 16, vocab), SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
        ): None
        for _ in range(args.num_streams)
    }
    last_token_time: dict[str, float] = {}
    itls: list[float] = []
    step = 0
    while engine.has_unfinished():
        if step % args.long_every == 0 and any(r in engine.requests for r in streams):
            engine.add_request(
                random_ids(rng, args.long_len, vocab), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            )
        for out in engine.step():
            if out.request_id not in streams:
                continue
            now = time.perf_counter()
            if out.request_id in last_token_time and out.outputs[0].delta_token_ids:
                itls.append(now - last_token_time[out.request_id])
            last_token_time[out.request_id] = now
        step += 1
    return {
        "chunked_prefill": chunked,
        "itl_p50_ms": 1000 * percentile(itls, 50),
        "itl_p99_ms": 1000 * percentile(itls, 99),
        "itl_max_ms": 1000 * max(itls),
        "steps": step,
    }


def hit_rate_multi_user(args) -> dict:
    engine = make_engine(args)
    vocab = engine.model.config.vocab_size
    rng = random.Random(2)
    systems = [random_ids(rng, 256, vocab) for _ in range(4)]
    prompts, users = [], []
    for i in range(48):
        prompts.append(systems[i % 4] + random_ids(rng, rng.randrange(16, 64), vocab))
        users.append(f"user{i % 4}")
    ids = []
    for prompt, user in zip(prompts, users):
        ids.append(engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), user=user))
        engine.step()  # one arrival per step
    while engine.has_unfinished():
        engine.step()
    sched = engine.scheduler
    return {
        "users": 4,
        "requests": 48,
        "system_prompt_tokens": 256,
        "hit_rate": sched.prefix_hit_tokens / max(1, sched.prefix_query_tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random-llama")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--system-len", type=int, default=1000)
    parser.add_argument("--num-requests", type=int, default=12)
    parser.add_argument("--num-streams", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--long-len", type=int, default=1536)
    parser.add_argument("--long-every", type=int, default=12, help="steps between long-prompt arrivals")
    parser.add_argument("--chunk-budget", type=int, default=256, help="--max-num-batched-tokens")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    results = {"model": args.model, "dtype": args.dtype, "torch_threads": torch.get_num_threads()}
    results["ttft"] = [ttft_shared_system_prompt(args, c) for c in (False, True)]
    results["itl"] = [itl_with_long_prompts(args, c) for c in (False, True)]
    results["hit_rate"] = hit_rate_multi_user(args)

    off, on = results["ttft"]
    print(f"model {args.model} ({args.dtype}), {results['torch_threads']} threads")
    print(f"\nTTFT, {args.system_len}-token shared system prompt + 32-token question, {args.num_requests} requests:")
    print(f"  {'':18}{'mean ms':>10}{'p50 ms':>10}{'p99 ms':>10}{'hit rate':>10}")
    for r in (off, on):
        name = "cache on" if r["prefix_caching"] else "cache off"
        print(
            f"  {name:18}{r['ttft_mean_ms']:10.1f}{r['ttft_p50_ms']:10.1f}{r['ttft_p99_ms']:10.1f}{r['hit_rate']:10.1%}"
        )
    print(f"  TTFT reduction (mean): {1 - on['ttft_mean_ms'] / off['ttft_mean_ms']:.1%}")
    off, on = results["itl"]
    print(
        f"\nDecode ITL, {args.num_streams} streams while a {args.long_len}-token prompt arrives every "
        f"{args.long_every} steps (budget {args.chunk_budget} tokens/step when chunked):"
    )
    print(f"  {'':18}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for r in (off, on):
        name = "chunked on" if r["chunked_prefill"] else "chunked off"
        print(f"  {name:18}{r['itl_p50_ms']:10.1f}{r['itl_p99_ms']:10.1f}{r['itl_max_ms']:10.1f}")
    print(f"  P99 ITL reduction: {1 - on['itl_p99_ms'] / off['itl_p99_ms']:.1%}")
    hr = results["hit_rate"]
    print(
        f"\nPrefix hit rate, {hr['users']} users x {hr['system_prompt_tokens']}-token system prompts, "
        f"{hr['requests']} requests: {hr['hit_rate']:.1%}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
