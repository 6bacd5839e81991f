"""KV memory utilization on a mixed-length workload: paged blocks vs contiguous preallocation.

Utilization = token slots holding a computed token / token slots allocated, averaged over the
engine steps of one run. Side by side, on the same run (the same requests running at each step):

- llmctl's paged KV cache: allocated = blocks held x block_size (one block at a time as a
  sequence grows; only the last block of a sequence is partly empty);
- contiguous preallocation of ``max_model_len`` slots per running request (what an engine without
  paging must reserve, since it cannot know the output length);
- contiguous preallocation of exactly ``prompt + max_tokens`` slots (the best a contiguous
  allocator could do if it knew every request's max_tokens, and every request ran to it).

usage: python -m benchmarks.features.kv_utilization [--model tiny-random-llama] [--requests 256]
"""

from __future__ import annotations

import argparse
import random

import torch

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random-llama")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engine = LLMEngine(
        model=args.model,
        skip_tokenizer=True,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        kv_cache_memory=1 << 30,
        enable_prefix_caching=False,
    )
    vocab = engine.model.config.vocab_size
    rng = random.Random(0)
    reserved_exact: dict[str, int] = {}
    for _ in range(args.requests):
        prompt_len = rng.randint(*args.prompt_len)
        max_tokens = rng.randint(*args.output_len)
        request_id = engine.add_request(
            [rng.randrange(3, vocab) for _ in range(prompt_len)],
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        )
        reserved_exact[request_id] = prompt_len + max_tokens

    bs = args.block_size
    paged, contiguous_max, contiguous_exact = [], [], []
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        running = engine.scheduler.running
        if not running:
            continue
        holding = sum(seq.num_computed_tokens for seq in running)
        blocks = len({b for seq in running for b in seq.block_table})
        paged.append(holding / (blocks * bs))
        contiguous_max.append(holding / (len(running) * args.max_model_len))
        contiguous_exact.append(holding / sum(reserved_exact[seq.request_id] for seq in running))

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    print(
        f"{args.requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, outputs "
        f"{args.output_len[0]}-{args.output_len[1]} tokens, max_num_seqs {args.max_num_seqs}, "
        f"max_model_len {args.max_model_len}, {steps} steps"
    )
    print(f"  {'allocation':48}{'KV utilization':>16}")
    print(f"  {f'paged, {bs}-token blocks (llmctl)':48}{mean(paged):16.1%}")
    print(f"  {'contiguous, max_model_len per request':48}{mean(contiguous_max):16.1%}")
    print(f"  {'contiguous, prompt + max_tokens per request':48}{mean(contiguous_exact):16.1%}")


if __name__ == "__main__":
    main()
