"""The vLLM-on-CPU peer workload through llmctl: 64 requests x 128 random prompt ids -> 128
output tokens, greedy, ignore_eos, one warm-up, REPS timed repetitions (median).

Same prompts (same seed and generator) as ../shared/peer/bench_common.py, same JSON fields as the
peer's bench_vllm.py / bench_hf.py, so ../shared/peer/summarize.py and compare_outputs.py read it.
benchmarks/peers/run_peer_comparison.sh runs vLLM, transformers and llmctl side by side in one run.

usage: python -m benchmarks.peers.peer_workload DTYPE MODEL OUT_JSON   (env REPS, default 1)
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import write_result
from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

N_REQ, PROMPT_LEN, OUT_LEN, VOCAB, SEED = 64, 128, 128, 32000, 1234


def make_prompts() -> list[list[int]]:
    rng = random.Random(SEED)
    return [[rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)] for _ in range(N_REQ)]


def main() -> None:
    dtype, model, out_json = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    t0 = time.time()
    engine = LLMEngine(
        model=model, dtype=dtype, skip_tokenizer=True, max_model_len=512, max_num_seqs=64, kv_cache_memory=4 << 30
    )
    init_s = time.time() - t0
    prompts = make_prompts()
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    params = SamplingParams(temperature=0, max_tokens=OUT_LEN, ignore_eos=True)
    walls, outs = [], []
    for _ in range(int(os.environ.get("REPS", "1"))):
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        walls.append(round(time.perf_counter() - start, 2))
    wall = sorted(walls)[len(walls) // 2]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = dict(
        engine=f"llmctl ({engine.ops.description})",
        dtype=dtype,
        n_req=N_REQ,
        prompt_len=PROMPT_LEN,
        out_len=OUT_LEN,
        total_out_tokens=n_out,
        wall_s=wall,
        out_tok_s=round(n_out / wall, 1),
        total_tok_s=round((n_out + N_REQ * PROMPT_LEN) / wall, 1),
        init_s=round(init_s, 1),
        walls=walls,
        torch_threads=torch.get_num_threads(),
        ld_preload=os.environ.get("LD_PRELOAD", ""),
        out_ids=[o.outputs[0].token_ids for o in outs],
    )
    out_json.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, out_json)


if __name__ == "__main__":
    main()
