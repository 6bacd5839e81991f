"""The engine forced onto the Triton kernels (Triton's interpreter on this CPU) produces the same
greedy tokens as the torch backend."""

from __future__ import annotations

from model_factory import random_prompts

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams


def greedy_tokens(backend: str, model_dir, prompts, **kw) -> list[list[int]]:
    engine = LLMEngine(model=str(model_dir), kernel_backend=backend, kv_cache_memory=2 << 20, **kw)
    assert engine.model.model.layers[0].self_attn.attn.ops.name == backend
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_triton_backend_matches_torch_on_random_model(llama_dir):
    # Two of the prompts share a 20-token prefix and the budget forces chunked prefill, so the
    # extend path (cached prefix + new chunk), mixed prefill/decode steps and decode all run.
    prefix = list(range(10, 30))
    prompts = [prefix + p for p in random_prompts(2, 320, 3, 12, seed=2)] + random_prompts(2, 320, 5, 40, seed=3)
    kw = dict(skip_tokenizer=True, dtype="float32", max_num_batched_tokens=24, block_size=16)
    assert greedy_tokens("triton", llama_dir, prompts, **kw) == greedy_tokens("torch", llama_dir, prompts, **kw)


def test_triton_backend_matches_torch_on_stories(stories_dir):
    prompts = ["Once upon a time", "Lily and Tom went to the park. They saw a big"]
    tok = LLMEngine(model=str(stories_dir), kv_cache_memory=1 << 20).tokenizer
    ids = [tok.encode(p) for p in prompts]
    assert greedy_tokens("triton", stories_dir, ids) == greedy_tokens("torch", stories_dir, ids)
