"""The transformers baseline runs the same model: llmctl's weights, renamed, give the same greedy
tokens; and its static-batch timelines follow the documented convention."""

from __future__ import annotations

import pytest
import torch

from llmctl.bench.baseline_hf import hf_state_dict, run_static_batches, to_hf_model
from llmctl.bench.datasets import BenchRequest, PromptFactory, random_requests
from llmctl.config import EngineConfig
from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("model", ["tiny-random-llama", "stories"])
def test_converted_model_generates_what_llmctl_generates(model, stories_dir):
    spec = str(stories_dir) if model == "stories" else model
    engine = LLMEngine(EngineConfig(model=spec, dtype="float32", kv_cache_memory=32 << 20, num_threads=1))
    hf = to_hf_model(engine.model)
    assert next(hf.parameters()).dtype == torch.float32
    names = hf_state_dict(engine.model)
    assert "model.layers.0.self_attn.k_proj.weight" in names and "model.layers.0.mlp.up_proj.weight" in names
    requests = random_requests(PromptFactory(engine.tokenizer), 3, 12, 10, 0.5, seed=2)
    outs = engine.generate(
        [r.prompt for r in requests],
        [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in requests],
    )
    for request, out in zip(requests, outs):
        assert hf_greedy(hf, request.prompt, request.output_len) == out.outputs[0].token_ids


def test_static_batches_timeline():
    engine = LLMEngine(EngineConfig(kv_cache_memory=32 << 20, num_threads=1))
    hf = to_hf_model(engine.model)
    assert next(hf.parameters()).dtype == engine.dtype
    workload = [
        BenchRequest([5] * 6, 6, 3),
        BenchRequest("a short text prompt", 5, 5),
        BenchRequest([7] * 9, 9, 2),
        BenchRequest([8] * 4, 4, 4),
        BenchRequest([9] * 3, 3, 1),
    ]
    done = []
    result = run_static_batches(hf, workload, batch_size=2, tokenizer=engine.tokenizer, on_done=done.append)
    records = result.records
    assert len(records) == len(done) == 5
    assert [r.output_tokens for r in records] == [3, 5, 2, 4, 1]
    assert [len(r.chunk_times) for r in records] == [3, 5, 2, 4, 1]
    assert records[1].prompt_tokens == len(engine.tokenizer.encode("a short text prompt"))
    batches = [records[0:2], records[2:4], records[4:]]
    for batch in batches:  # one start, one first token, one end per batch
        assert len({r.start for r in batch}) == len({r.end for r in batch}) == len({r.ttft for r in batch}) == 1
        for r in batch:
            assert r.start < r.chunk_times[0] and r.chunk_times[-1] <= r.end
    for earlier, later in zip(batches, batches[1:]):
        assert later[0].start >= earlier[0].end  # static: a batch starts when the previous one returned
    # the shorter request of a batch still ends with the batch: its TPOT carries the wait
    short, long = batches[0]
    assert short.end == long.end and short.chunk_times == long.chunk_times[:3]
    assert result.duration_s >= records[-1].end - records[0].start
