"""Run under torchrun by the parallel tests: every model of a list through one TP x PP engine.

Rank 0 runs ``LLMEngine.generate`` (greedy, token-id prompts, with prompt logprobs on one
request), then the same prompts again aborting half of them after a few steps (with pipeline
parallelism their batches are in flight), and writes the tokens, the blocks still held and the
pipeline's overlap as JSON; the other ranks run the worker loop, once per model.
Usage: torchrun ... greedy_ranks.py SPEC.json OUT.json
"""

from __future__ import annotations

import json
import os
import sys

from llmctl.config import EngineConfig
from llmctl.engine.llm_engine import LLMEngine
from llmctl.parallel.worker import run_worker
from llmctl.sampling_params import SamplingParams


def run_with_aborts(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> int:
    """Abort every other request after a few steps, finish the rest; the KV blocks still held."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(6):
        engine.step()
    for request_id in ids[::2]:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    engine.block_manager.check_invariants(engine.live_sequences())
    return engine.block_manager.num_blocks - engine.block_manager.num_free_blocks


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    results = {}
    for model_dir in spec["models"]:
        config = EngineConfig(model=model_dir, skip_tokenizer=True, **spec["engine"])
        if int(os.environ["RANK"]) != 0:
            run_worker(config)
            continue
        engine = LLMEngine(config)
        params = [
            SamplingParams(
                temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True, prompt_logprobs=1 if i == 0 else None
            )
            for i in range(len(spec["prompts"]))
        ]
        outputs = engine.generate(spec["prompts"], params)
        results[model_dir] = {
            "tokens": [o.outputs[0].token_ids for o in outputs],
            "prompt_logprobs": [sorted(d.items()) if d else None for d in outputs[0].prompt_logprobs or []],
            "overlapped_launches": engine.pipeline.overlapped_launches if engine.pipeline else 0,
            "blocks_held_after_aborts": run_with_aborts(engine, spec["prompts"], spec["max_tokens"]),
        }
        engine.runner.shutdown()
    if int(os.environ["RANK"]) == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
