"""Greedy tokens with tensor parallelism 2, pipeline parallelism 2 and both are identical to one
process, in fp32 on the CPU, on random Llama, Qwen2, Qwen3 and mixture-of-experts checkpoints
(Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V2 and V2-Lite with latent attention), on gpt-oss
and Gemma 3 (sliding and full layers: tensor parallelism only) and on stories260k.

The batches exercise chunked prefill (a 16-token budget), mixed prefill + decode steps, pipeline
micro-batches (several sequences per step) and an uneven layer split (stories260k's 5 layers over
2 stages: 2 + 3). Prompt logprobs, which take extra logits rows through the last stage, agree too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_factory import random_prompts
from parallel_helpers import HERE, torchrun

from llmctl.config import EngineConfig
from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

ENGINE = dict(dtype="float32", device="cpu", num_threads=1, kv_cache_memory=8 << 20, max_num_batched_tokens=16)
MAX_TOKENS = 8
KV_GROUP_FAMILIES = ("gpt_oss", "gemma3")  # pipeline stages do not take several KV-cache groups yet
PROMPTS = random_prompts(4, 320, 3, 24, seed=7)


@pytest.fixture(scope="module")
def model_dirs(hf_model_dirs, stories_dir) -> list[str]:
    # the MoE families shard every expert's intermediate dimension across ranks (shared expert too);
    # DeepSeek-V2's latent attention shards its heads and computes the cached latent on every rank;
    # gpt-oss and Gemma 3 mix sliding and full layers (two KV-cache groups: tensor parallel only)
    families = (
        "llama",
        "qwen2",
        "qwen3",
        "qwen2_moe",
        "qwen3_moe",
        "mixtral",
        "olmoe",
        "gpt_oss",
        "gemma3",
        "deepseek_v2_lite",
        "deepseek_v2",
    )
    return [str(hf_model_dirs[f]) for f in families] + [str(stories_dir)]


@pytest.fixture(scope="module")
def single_process(model_dirs) -> dict[str, dict]:
    results = {}
    for model_dir in model_dirs:
        # the suite's thread count stays as it is: only the ranks run one thread each
        engine = LLMEngine(EngineConfig(model=model_dir, skip_tokenizer=True, **{**ENGINE, "num_threads": None}))
        params = [
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=1 if i == 0 else None)
            for i in range(len(PROMPTS))
        ]
        outputs = engine.generate(PROMPTS, params)
        results[model_dir] = {
            "tokens": [o.outputs[0].token_ids for o in outputs],
            "prompt_logprobs": outputs[0].prompt_logprobs,
        }
    return results


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_greedy_tokens_match_one_process(tmp_path, model_dirs, single_process, tp, pp):
    if pp > 1:
        model_dirs = [d for d in model_dirs if Path(d).name not in KV_GROUP_FAMILIES]
    spec = tmp_path / "spec.json"
    out = tmp_path / "out.json"
    spec.write_text(
        json.dumps(
            {
                "models": model_dirs,
                "prompts": PROMPTS,
                "max_tokens": MAX_TOKENS,
                "engine": {**ENGINE, "tensor_parallel_size": tp, "pipeline_parallel_size": pp},
            }
        )
    )
    # every step with two sequences or more is split into micro-batches, however few its tokens
    torchrun(
        str(HERE / "greedy_ranks.py"), str(spec), str(out), nproc=tp * pp, env={"LLMCTL_PP_MICRO_BATCH_MIN_TOKENS": "1"}
    )
    results = json.loads(out.read_text())
    for model_dir in model_dirs:
        expected, got = single_process[model_dir], results[model_dir]
        assert got["tokens"] == expected["tokens"], model_dir
        assert got["blocks_held_after_aborts"] == 0, model_dir  # aborts while in flight leak nothing
        if pp > 1:  # a batch was launched while another was still in the later stage
            assert got["overlapped_launches"] > 0, model_dir
        for want, have in zip(expected["prompt_logprobs"], got["prompt_logprobs"], strict=True):
            if want is None:
                assert have is None
                continue
            have = {int(token): value for token, value in have}
            assert have.keys() == want.keys()
            for token, value in want.items():
                assert have[token] == pytest.approx(value, abs=1e-4)
