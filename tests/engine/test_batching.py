"""Continuous batching is exact: a request's tokens do not depend on its batch or on preemption."""

from __future__ import annotations

import pytest
from model_factory import random_prompts

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

VOCAB = 320


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 8 << 20)
    return LLMEngine(model=str(model_dir), skip_tokenizer=True, dtype="float32", **kw)


def sampling_params(i: int, greedy: bool) -> SamplingParams:
    if greedy:
        return SamplingParams(temperature=0, max_tokens=10 + i % 7, ignore_eos=True)
    return SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1000 + i, max_tokens=10 + i % 7, ignore_eos=True)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded-sampling"])
def test_batched_equals_alone(llama_dir, greedy):
    prompts = random_prompts(12, VOCAB, 2, 40, seed=3)
    engine = make_engine(llama_dir)
    alone = [engine.generate([p], [sampling_params(i, greedy)])[0].outputs[0].token_ids for i, p in enumerate(prompts)]
    together = engine.generate(prompts, [sampling_params(i, greedy) for i in range(len(prompts))])
    assert [o.outputs[0].token_ids for o in together] == alone
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_unseeded_sampling_differs_between_requests(llama_dir):
    engine = make_engine(llama_dir)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    outs = engine.generate([[5, 6, 7]] * 4, params)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded-sampling"])
def test_tiny_pool_preempts_and_matches_large_pool(llama_dir, greedy):
    prompts = random_prompts(24, VOCAB, 10, 60, seed=5)
    params = [sampling_params(i, greedy) for i in range(len(prompts))]
    expected = make_engine(llama_dir).generate(prompts, params)

    # 16 blocks of 16 tokens: room for ~3 of these sequences at a time, 24 arrive together.
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32
    small = make_engine(llama_dir, kv_cache_memory=16 * block_bytes, max_model_len=128)
    assert small.block_manager.num_blocks == 16
    ids = [small.add_request(p, sp) for p, sp in zip(prompts, params)]
    results = {}
    while small.has_unfinished():
        for out in small.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        small.block_manager.check_invariants(small.live_sequences())
    assert small.scheduler.num_preemptions > 0
    assert [results[i] for i in ids] == [o.outputs[0].token_ids for o in expected]
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks
