"""Greedy output must be token-identical to transformers (fp32, CPU) for every supported family,
alone and when 16 requests of different lengths join the batch at different steps; the chosen
tokens' log-probabilities must match too (greedy tokens alone cannot see a scale on the logits)."""

from __future__ import annotations

import pytest
import torch
from model_factory import FAMILIES, hf_greedy, random_prompts

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

VOCAB = 320


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 8 << 20)
    return LLMEngine(model=str(model_dir), skip_tokenizer=True, dtype="float32", **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_single_requests_match_transformers(hf_model_dirs, family):
    model_dir = hf_model_dirs[family]
    prompts = [[5], [7, 8, 9, 10, 11, 12, 13], list(range(20, 36)), list(range(3, 36))]  # 1, 7, 16, 33 tokens
    expected = hf_greedy(model_dir, prompts, 24)
    engine = make_engine(model_dir)
    for prompt, want in zip(prompts, expected):
        (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_chosen_token_logprobs_match_transformers(hf_model_dirs, family):
    from transformers import AutoModelForCausalLM

    model_dir = hf_model_dirs[family]
    prompt = list(range(3, 20))
    (out,) = make_engine(model_dir).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    )
    tokens = out.outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_sixteen_staggered_requests_match_transformers(hf_model_dirs, family):
    model_dir = hf_model_dirs[family]
    prompts = random_prompts(16, VOCAB, 1, 60, seed=FAMILIES.index(family))
    lengths = [8 + (i * 5) % 17 for i in range(16)]
    expected = hf_greedy(model_dir, prompts, max(lengths))
    engine = make_engine(model_dir, max_num_batched_tokens=64)  # forces chunked prefill of the longer prompts
    results: dict[str, list[int]] = {}
    ids = []
    pending = list(zip(prompts, lengths))
    steps = 0
    while pending or engine.has_unfinished():
        for _ in range(2):  # two new arrivals per step while any remain
            if pending:
                prompt, n = pending.pop(0)
                ids.append(engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        steps += 1
        engine.block_manager.check_invariants(engine.live_sequences())
    mixed = [r.num_seqs for r in engine.stats.steps if r.prefill_tokens and r.decode_tokens]
    assert mixed, "no step mixed prefill and decode"
    for request_id, n, want in zip(ids, lengths, expected):
        assert results[request_id] == want[:n], request_id
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_granite_decodes_on_the_module_path_and_says_why(hf_model_dirs, monkeypatch):
    """The native decode loop has no residual multiplier: Granite decodes through the modules (exact,
    as above), and wherever the loop would otherwise run the start-up line names the reason."""
    monkeypatch.setenv("LLMCTL_DECODE_LOOP", "1")
    engine = make_engine(hf_model_dirs["granite"])
    assert engine.runner.native_decode is None
    if engine.model.model.norm.ops.kernels.decode_loop_why_not() is None:  # the kernels would take it
        assert engine.runner.decode_path == "decode: Python modules (GraniteForCausalLM's residual multiplier)"
