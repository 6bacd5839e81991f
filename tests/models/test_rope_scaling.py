"""Rope scalings bit for bit against transformers: inverse frequencies and cos/sin tables (yarn,
longrope, llama3, partial rotary), end-to-end greedy tokens for yarn configs, and Phi-3's LongRoPE
rule (short factors up to ``original_max_position_embeddings`` tokens, long ones for all of a longer
sequence) with prompts and generations crossing that length, alone and batched."""

from __future__ import annotations

import pytest
import torch
from model_factory import hf_greedy, make_hf_model

from llmctl.engine.llm_engine import LLMEngine
from llmctl.errors import UnsupportedModelError
from llmctl.layers.ops import TorchOps
from llmctl.layers.rotary import RotaryEmbedding, attention_factor, inverse_frequencies
from llmctl.sampling_params import SamplingParams

HEAD_DIM = 32
MAX_POSITIONS = 256

YARN = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 6.0, "original_max_position_embeddings": 48, "beta_fast": 8, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 40, "truncate": False},
    {"rope_type": "yarn", "factor": 5.0, "original_max_position_embeddings": 64, "mscale": 0.8, "mscale_all_dim": 0.3},
    {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 64, "attention_factor": 1.3},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5},
]
LLAMA3 = [
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 2.0,
        "high_freq_factor": 6.0,
        "original_max_position_embeddings": 100,
    },
]
SHORT = [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)]
LONG = [2.0 + 1.5 * i for i in range(HEAD_DIM // 2)]
LONGROPE = [
    {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": 32},
    {
        "rope_type": "longrope",
        "short_factor": SHORT[:8],
        "long_factor": LONG[:8],
        "original_max_position_embeddings": 16,
        "partial_rotary_factor": 0.5,
        "attention_factor": 1.1,
    },
    {  # factor given: it, not max_position_embeddings / original, sets the attention factor
        "rope_type": "longrope",
        "short_factor": SHORT,
        "long_factor": LONG,
        "original_max_position_embeddings": 64,
        "factor": 16.0,
    },
]


def _hf_config(scaling: dict):
    """A transformers config whose rope parameters are ``scaling`` (Phi3Config for longrope, whose
    own rules for ``original_max_position_embeddings`` apply; LlamaConfig otherwise)."""
    from transformers import LlamaConfig, Phi3Config

    scaling = dict(scaling)
    common = dict(
        hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=MAX_POSITIONS, rope_theta=5000.0
    )
    if scaling["rope_type"] == "longrope":
        omp = scaling.pop("original_max_position_embeddings")
        partial = scaling.pop("partial_rotary_factor", 1.0)
        return Phi3Config(
            **common, original_max_position_embeddings=omp, partial_rotary_factor=partial, rope_scaling=scaling
        )
    return LlamaConfig(**common, rope_scaling=scaling)


def _hf_inv_freq(scaling: dict, long: bool = False) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _hf_config(scaling)
    omp = config.rope_parameters.get("original_max_position_embeddings", 0)
    return ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu", seq_len=omp + 1 if long else None)


@pytest.mark.parametrize("scaling", YARN + LLAMA3 + LONGROPE, ids=lambda s: s["rope_type"])
def test_inverse_frequencies_and_attention_factor_equal_transformers(scaling):
    rotary_dim = int(HEAD_DIM * scaling.get("partial_rotary_factor", 1.0))
    for long in (False, True) if scaling["rope_type"] == "longrope" else (False,):
        want, want_factor = _hf_inv_freq(scaling, long)
        got = inverse_frequencies(rotary_dim, 5000.0, scaling, MAX_POSITIONS, long=long)
        assert torch.equal(got, want), (scaling, long)
        assert attention_factor(scaling, MAX_POSITIONS) == want_factor
    if scaling["rope_type"] == "yarn" and "attention_factor" not in scaling:
        assert attention_factor(scaling, MAX_POSITIONS) != 1.0  # the cos/sin scale is exercised


@pytest.mark.parametrize("scaling", YARN + LONGROPE, ids=lambda s: s["rope_type"])
def test_cos_sin_tables_equal_transformers_rotary_embedding(scaling):
    """The table rows are the cos and sin transformers' rotary module returns for those positions
    (attention factor included); longrope's second table is its long one."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = _hf_config(scaling)
    longrope = scaling["rope_type"] == "longrope"
    hf = (Phi3RotaryEmbedding if longrope else LlamaRotaryEmbedding)(config)
    ours = RotaryEmbedding(HEAD_DIM, MAX_POSITIONS, 5000.0, scaling, ops=TorchOps())
    omp = config.rope_parameters["original_max_position_embeddings"]
    x = torch.zeros(1, 1, HEAD_DIM)
    for long in (False, True) if longrope else (False,):
        length = MAX_POSITIONS if long or not longrope else omp  # transformers picks by the length
        cos, sin = hf(x, torch.arange(length)[None])
        half = ours.rotary_dim // 2
        rows = ours.cos_sin_cache[torch.arange(length) + (MAX_POSITIONS if long else 0)]
        assert torch.equal(rows[:, :half], cos[0, :, :half]), long
        assert torch.equal(rows[:, half:], sin[0, :, :half]), long


def test_unsupported_scaling_names_the_supported_kinds():
    with pytest.raises(UnsupportedModelError, match="supported: default, linear, llama3, yarn, longrope"):
        RotaryEmbedding(HEAD_DIM, 64, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, ops=TorchOps())


def _engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 8 << 20)
    return LLMEngine(model=str(model_dir), skip_tokenizer=True, dtype="float32", **kw)


def _greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [out.outputs[0].token_ids for out in engine.generate(prompts, params)]


@pytest.mark.parametrize(
    ("family", "scaling"),
    [
        ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
        (
            "llama",
            {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 24,
                "beta_fast": 16,
                "beta_slow": 2,
                "mscale": 1.2,
                "mscale_all_dim": 0.5,
                "truncate": False,
            },
        ),
    ],
    ids=["qwen2", "llama"],
)
def test_yarn_models_match_transformers(tmp_path, family, scaling):
    model_dir = make_hf_model(family, tmp_path / family, seed=5, rope_scaling=scaling)
    prompts = [[5, 6, 7], list(range(10, 50))]
    assert _greedy(_engine(model_dir), prompts, 20) == hf_greedy(model_dir, prompts, 20)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return make_hf_model("phi3", tmp_path_factory.mktemp("phi3") / "phi3", seed=11)


def test_phi3_prompts_and_generations_crossing_the_original_length(phi3_dir):
    """original_max_position_embeddings is 32: prompts below, at, and above it, generations that
    cross it at different steps, alone, then all together with chunked prefill (a long prompt's
    first chunk ends below 32 tokens, so its keys are recomputed with the long table)."""
    prompts = [[9] * 3, list(range(40, 60)), list(range(3, 34)), list(range(100, 132)), list(range(7, 47))]
    expected = hf_greedy(phi3_dir, prompts, 16)
    engine = _engine(phi3_dir)
    assert [_greedy(engine, [p], 16)[0] for p in prompts] == expected
    batched = _engine(phi3_dir, max_num_batched_tokens=24, enable_prefix_caching=False)
    assert _greedy(batched, prompts, 16) == expected
    assert batched.block_manager.num_free_blocks == batched.block_manager.num_blocks


def test_phi3_long_factors_matter(phi3_dir):
    """The model's two tables differ, and a long prompt gives other tokens with the short one."""
    engine = _engine(phi3_dir)
    rotary = engine.model.model.rotary
    n = rotary.max_positions
    assert not torch.equal(rotary.cos_sin_cache[:n], rotary.cos_sin_cache[n:])
    assert rotary.rotary_dim == 12 and rotary.head_dim == 16  # partial_rotary_factor 0.75


def test_phi3_runs_without_prefix_caching_and_shared_prefixes_stay_exact(phi3_dir):
    """A short sequence's cached keys use the short table, a long one's the long table: the engine
    turns prefix caching off for a LongRoPE model (and says why), so requests sharing a prefix on
    either side of the original length (32) still match transformers when run together."""
    prefix = list(range(50, 74))  # 24 tokens: one short request, one that crosses 32 in its prompt
    prompts = [prefix + [3, 4], prefix + list(range(80, 100)), prefix + [5]]
    expected = hf_greedy(phi3_dir, prompts, 12)
    engine = _engine(phi3_dir, enable_prefix_caching=True, max_num_batched_tokens=32)
    assert engine.prefix_caching_why_not is not None
    assert not engine.block_manager.enable_prefix_caching
    assert "no prefix caching (LongRoPE" in engine.kv_description
    assert _greedy(engine, prompts, 12) == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_phi3_without_longrope_keeps_prefix_caching(tmp_path):
    model_dir = make_hf_model("phi3", tmp_path / "phi3-plain", seed=3, rope_scaling=None)
    engine = _engine(model_dir, enable_prefix_caching=True)
    assert engine.prefix_caching_why_not is None and engine.block_manager.enable_prefix_caching


def test_phi3_longrope_refuses_a_window_inside_the_original_length(tmp_path):
    model_dir = make_hf_model("phi3", tmp_path / "phi3-window", seed=3, sliding_window=16)
    with pytest.raises(UnsupportedModelError, match="sliding window no longer than"):
        _engine(model_dir)
