"""The peer workload's prefill alone: 64 requests x 128 random prompt ids -> 1 output token,
greedy, in vLLM or llmctl (fp32). Says how much of benchmarks/peers/peer_workload.py's wall time is
prefill in each engine, so that a ratio of the whole run can be split into its prefill and decode
parts. The warm-up uses prompts of another seed: no block of the timed prompts is cached.

    cd $PEER_WORK && VLLM_CPU_OMP_THREADS_BIND=0-1 venv/bin/python \\
        $LLMCTL/benchmarks/peers/prefill_only.py vllm models/llama250m   # by its path: vLLM's venv
    .venv/bin/python -m benchmarks.peers.prefill_only llmctl $PEER_WORK/models/llama250m

Prints one RESULT line (JSON). It imports only the engine it runs, so the vLLM venv needs no llmctl.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

N_REQ, PROMPT_LEN, VOCAB, SEED = 64, 128, 32000, 1234  # as benchmarks/peers/peer_workload.py


def make_prompts(seed: int = SEED, n: int = N_REQ) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)] for _ in range(n)]


def run_vllm(model: str) -> float:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        skip_tokenizer_init=True,
        seed=0,
        max_num_seqs=64,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    generate(make_prompts(seed=SEED + 1, n=2), 8)
    start = time.perf_counter()
    generate(make_prompts(), 1)
    return time.perf_counter() - start


def run_llmctl(model: str) -> float:
    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.sampling_params import SamplingParams

    engine = LLMEngine(
        model=model, dtype="float32", skip_tokenizer=True, max_model_len=512, max_num_seqs=64, kv_cache_memory=4 << 30
    )
    engine.generate(make_prompts(seed=SEED + 1, n=2), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    start = time.perf_counter()
    engine.generate(make_prompts(), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return time.perf_counter() - start


def main() -> None:
    engine, model = sys.argv[1], sys.argv[2]
    runners = {"vllm": run_vllm, "llmctl": run_llmctl}
    if engine not in runners:
        sys.exit(f"usage: prefill_only.py vllm|llmctl MODEL (not {engine!r})")
    wall = runners[engine](model)
    tokens = N_REQ * PROMPT_LEN
    print(
        "RESULT",
        json.dumps(
            dict(engine=engine, prompt_tokens=tokens, wall_s=round(wall, 2), prompt_tok_s=round(tokens / wall, 1))
        ),
    )


if __name__ == "__main__":  # vLLM's workers re-import this module
    main()
