"""SmolLM3 (layers without rotary embedding) and OLMo 2 (norms after attention and MLP, q/k norms over
the whole projection) beyond tests/models/test_models_exact.py: prefix caching (a cached block's
keys must be those the layer computed, rotated or not), the config defaults each family's
transformers config applies, the decode path's start-up line, and tensor parallelism (the OLMo 2
q/k norms span every rank's heads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_factory import hf_greedy, make_hf_model, random_prompts

from llmctl.engine.llm_engine import LLMEngine
from llmctl.layers.ops import TorchOps
from llmctl.layers.rotary import inverse_frequencies
from llmctl.models.config import ModelConfig
from llmctl.models.loader import build_model
from llmctl.models.smollm3 import rope_layers
from llmctl.sampling_params import SamplingParams

VOCAB = 320
REPO_ROOT = Path(__file__).resolve().parents[2]


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 8 << 20)
    return LLMEngine(model=str(model_dir), skip_tokenizer=True, dtype="float32", **kw)


@pytest.mark.parametrize("family", ["smollm3", "olmo2"])
def test_shared_prefix_from_the_cache_matches_transformers(hf_model_dirs, family):
    model_dir = hf_model_dirs[family]
    system = random_prompts(1, VOCAB, 45, 45, seed=11)[0]  # 2 full blocks + 13 tokens
    prompts = [system + suffix for suffix in random_prompts(4, VOCAB, 1, 20, seed=12)]
    expected = hf_greedy(model_dir, prompts, 10)
    engine = make_engine(model_dir, enable_prefix_caching=True, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = [engine.generate([prompt], params)[0] for prompt in prompts]  # one after the other: later ones hit
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.num_cached_tokens for o in outputs] == [0, 32, 32, 32]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    ("family", "reason"),
    [
        ("smollm3", "SmolLM3ForCausalLM's layers without rotary embedding"),
        ("olmo2", "Olmo2ForCausalLM's norms after attention and MLP"),
    ],
)
def test_decodes_on_the_module_path_and_says_why(hf_model_dirs, monkeypatch, family, reason):
    """The native decode loop rotates every layer's q/k and norms before attention and MLP: these
    families decode through the modules (exact, as test_models_exact.py checks), and wherever the
    loop would otherwise run the start-up line names the reason."""
    monkeypatch.setenv("LLMCTL_DECODE_LOOP", "1")
    engine = make_engine(hf_model_dirs[family])
    assert engine.runner.native_decode is None
    if engine.model.model.norm.ops.kernels.decode_loop_why_not() is None:  # the kernels would take it
        assert engine.runner.decode_path == f"decode: Python modules ({reason})"


def test_smollm3_rope_layers_follow_the_transformers_config():
    from transformers import SmolLM3Config

    for layers, extra in [(9, {}), (5, {"no_rope_layer_interval": 2}), (3, {"no_rope_layers": [0, 1, 1, 0]})]:
        hf = SmolLM3Config(num_hidden_layers=layers, **extra)
        cfg = ModelConfig.from_dict(
            {"architectures": ["SmolLM3ForCausalLM"], **_tiny(num_hidden_layers=layers), **extra}
        )
        assert rope_layers(cfg) == [bool(flag) for flag in hf.no_rope_layers[:layers]], extra


def _tiny(**fields):
    return {
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        **fields,
    }


def _build(architecture: str, **fields):
    cfg = ModelConfig.from_dict({"architectures": [architecture], **_tiny(**fields)})
    return build_model(cfg, dtype=torch.float32, device=torch.device("cpu"), ops=TorchOps())


def test_config_fields_left_out_get_the_family_defaults():
    """transformers' SmolLM3Config ties the embeddings and uses rope base 2e6, Olmo2Config's norm eps
    is 1e-5; a config.json that leaves them out means those, not llmctl's generic fallbacks."""
    smol = _build("SmolLM3ForCausalLM")
    assert smol.config.tie_word_embeddings and smol.lm_head.weight is smol.model.embed_tokens.weight
    rotary = smol.model.layers[0].self_attn.rotary_emb
    inv_freq = inverse_frequencies(8, 2_000_000.0, None)
    assert torch.equal(rotary.cos_sin_cache[5, :4], (5 * inv_freq).cos())
    stated = _build("SmolLM3ForCausalLM", tie_word_embeddings=False, rope_theta=10_000.0)
    assert not stated.config.tie_word_embeddings
    assert torch.equal(
        stated.model.layers[0].self_attn.rotary_emb.cos_sin_cache[5, :4],
        (5 * inverse_frequencies(8, 10_000.0, None)).cos(),
    )

    olmo = _build("Olmo2ForCausalLM")
    layer = olmo.model.layers[0]
    norms = [olmo.model.norm, layer.post_attention_layernorm, layer.post_feedforward_layernorm, layer.self_attn.q_norm]
    assert {norm.eps for norm in norms} == {1e-5}
    assert _build("Olmo2ForCausalLM", rms_norm_eps=1e-3).model.norm.eps == 1e-3
    assert not hasattr(layer, "input_layernorm")
    assert layer.self_attn.q_norm.weight.shape == (16,) and layer.self_attn.k_norm.weight.shape == (16,)


@pytest.mark.parallel
@pytest.mark.subprocess
@pytest.mark.slow
def test_tensor_parallel_matches_transformers(tmp_path, hf_model_dirs):
    """TP 2: OLMo 2's q/k norms gather the whole projection (with 2 KV heads, and with 1 KV head
    replicated on both ranks); SmolLM3's layers keep their own rotary choice."""
    mqa = make_hf_model("olmo2", tmp_path / "olmo2-mqa", seed=3, num_key_value_heads=1)
    models = [str(hf_model_dirs["olmo2"]), str(mqa), str(hf_model_dirs["smollm3"])]
    prompts = random_prompts(3, VOCAB, 3, 24, seed=7)
    engine = dict(dtype="float32", device="cpu", num_threads=1, kv_cache_memory=8 << 20, max_num_batched_tokens=16)
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(
        json.dumps(
            {"models": models, "prompts": prompts, "max_tokens": 8, "engine": {**engine, "tensor_parallel_size": 2}}
        )
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--max-restarts", "0", str(REPO_ROOT / "tests/parallel/greedy_ranks.py"), str(spec), str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"torchrun failed:\n{done.stdout}\n{done.stderr}"
    results = json.loads(out.read_text())
    for model_dir in models:
        assert results[model_dir]["tokens"] == hf_greedy(Path(model_dir), prompts, 8), model_dir
