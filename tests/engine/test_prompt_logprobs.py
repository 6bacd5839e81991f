"""SamplingParams.prompt_logprobs: every prompt position's logprob equals transformers'
log_softmax (fp32), with chunked prefill, and with a prefix-cache hit the request must not take."""

from __future__ import annotations

import pytest
import torch
from model_factory import random_prompts

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

TOP = 3


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the distribution over prompt token i + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches(got: list[dict[int, float] | None], prompt: list[int], want: torch.Tensor, k: int = TOP) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for i, entry in enumerate(got[1:]):
        token = prompt[i + 1]
        top_values, top_ids = want[i].topk(k)
        assert set(entry) == {token, *top_ids.tolist()}
        assert next(iter(entry)) == token  # the prompt's own token first
        assert entry[token] == pytest.approx(want[i, token].item(), abs=1e-4)
        for value, token_id in zip(top_values.tolist(), top_ids.tolist()):
            assert entry[token_id] == pytest.approx(value, abs=1e-4)


def engine_for(model_dir, **kw) -> LLMEngine:
    return LLMEngine(model=str(model_dir), skip_tokenizer=True, dtype="float32", kv_cache_memory=8 << 20, **kw)


@pytest.mark.parametrize("chunk", [2048, 16, 7])  # whole prompts, then chunked prefill at two widths
def test_prompt_logprobs_match_transformers(llama_dir, chunk):
    prompts = random_prompts(3, 320, 20, 45, seed=3)
    engine = engine_for(llama_dir, max_num_batched_tokens=chunk)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert_matches(out.prompt_logprobs, prompt, hf_prompt_logprobs(llama_dir, prompt))
    assert engine.counters().kv_free_blocks == engine.counters().kv_num_blocks


def test_prompt_logprobs_ignore_a_prefix_cache_hit(llama_dir):
    prompt = random_prompts(1, 320, 50, 50, seed=9)[0]  # three full blocks of 16 and a partial one
    engine = engine_for(llama_dir)
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # fills the prefix cache
    (plain,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    assert plain.num_cached_tokens == 48 and plain.prompt_logprobs is None
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    assert out.num_cached_tokens == 0
    assert_matches(out.prompt_logprobs, prompt, hf_prompt_logprobs(llama_dir, prompt), k=0)


def test_prompt_logprobs_on_stories260k(stories_dir):
    engine = LLMEngine(model=str(stories_dir), dtype="float32", kv_cache_memory=4 << 20, max_num_batched_tokens=4)
    (out,) = engine.generate(
        ["Once upon a time, there was a little girl"], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    )
    assert_matches(
        out.prompt_logprobs, out.prompt_token_ids, hf_prompt_logprobs(stories_dir, out.prompt_token_ids), k=2
    )
