"""Mixture-of-experts families in the engine: the decode path they take, and the per-expert token
counts the stats snapshot shows (their exactness against transformers is test_models_exact.py's)."""

from __future__ import annotations

import pytest
from model_factory import hf_greedy

from llmctl.engine.llm_engine import LLMEngine
from llmctl.layers.moe import StackedExperts
from llmctl.sampling_params import SamplingParams


def make_engine(model_dir) -> LLMEngine:
    return LLMEngine(model=str(model_dir), skip_tokenizer=True, dtype="float32", kv_cache_memory=8 << 20)


def test_the_stats_snapshot_counts_the_tokens_each_expert_took(hf_model_dirs):
    engine = make_engine(hf_model_dirs["qwen2_moe"])
    assert make_engine(hf_model_dirs["llama"]).stats_snapshot()["experts"] is None  # no experts, no section
    prompts = [list(range(3, 20)), [5, 6, 7]]
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    section = engine.stats_snapshot()["experts"]
    layers = {row["layer"]: row for row in section["layers"]}
    assert set(layers) == {"model.layers.0", "model.layers.2"}  # layer 1 is dense (mlp_only_layers)
    for row in layers.values():
        assert len(row["tokens"]) == 6
        # every prompt token once and every generated token but the last, 2 experts each
        assert sum(row["tokens"]) == 2 * (17 + 3 + 2 * 3)
    assert 0.0 < section["read_share_per_step"] <= 1.0


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_the_triton_fused_experts_match_transformers(hf_model_dirs, family):
    """On the Triton kernel set (its interpreter here) every MoE layer runs the fused-experts
    kernel (kernels/moe_triton.py) instead of the per-expert loop; greedy tokens, batched with
    staggered lengths, are still transformers'."""
    model_dir = hf_model_dirs[family]
    prompts = [list(range(3, 20)), [5, 6, 7], list(range(40, 71))]
    expected = hf_greedy(model_dir, prompts, 6)
    engine = LLMEngine(
        model=str(model_dir), skip_tokenizer=True, dtype="float32", kv_cache_memory=8 << 20, kernel_backend="triton"
    )
    experts = [m for m in engine.model.modules() if isinstance(m, StackedExperts)]
    assert experts and all(e.fused is not None and not e.panels for e in experts)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(sum(row["tokens"]) for row in engine.stats_snapshot()["experts"]["layers"]) > 0
