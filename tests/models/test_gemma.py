"""Gemma 2 and Gemma 3 (text), and Gemma 1, beyond tests/models/test_models_exact.py: every prompt
position's logits against transformers' (soft-capped, through local and global layers), prompts far
past the sliding window, chunked and batched, a shared prefix from the prefix cache, the config
defaults and transformers-4 config keys, the norm and GeGLU bit for bit, the decode path's start-up
line and the architectures refused. The tiny models (tests/model_factory.py) have an 8-token window,
attention soft-cap 5 (Gemma 2), final soft-cap 3 and random norm weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_factory import hf_greedy, make_hf_model, random_prompts

from llmctl.engine.llm_engine import LLMEngine
from llmctl.errors import ModelLoadError, UnsupportedModelError
from llmctl.layers.norm import GemmaRMSNorm
from llmctl.layers.ops import AttentionMetadata, TorchOps
from llmctl.models import registry
from llmctl.models.calibration import bind_scratch_kv, unbind_kv
from llmctl.models.config import ModelConfig
from llmctl.models.gemma import FULL, SLIDING, gemma_settings
from llmctl.models.loader import build_model, load_model
from llmctl.sampling_params import SamplingParams

VOCAB = 320
GEMMAS = ["gemma2", "gemma3"]


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 8 << 20)
    return LLMEngine(model=str(model_dir), skip_tokenizer=True, dtype="float32", **kw)


def llmctl_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """Every position's logits from llmctl's model, one prefill (native CPU kernels on)."""
    model = load_model(model_dir, dtype="float32", device=torch.device("cpu"), ops=TorchOps(native_cpu=True))
    bind_scratch_kv(model, len(ids), torch.float32)
    try:
        with torch.inference_mode():
            meta = AttentionMetadata.single_prefill(len(ids), 16)
            hidden = model(torch.tensor(ids), torch.arange(len(ids)), meta)
            return model.compute_logits(hidden)
    finally:
        unbind_kv(model)


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(model_dir)(torch.tensor([ids])).logits[0]


def variant(model_dir: Path, out_dir: Path, drop: tuple[str, ...] = (), **changes) -> Path:
    """A copy of a checkpoint with config.json keys dropped or changed."""
    shutil.copytree(model_dir, out_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    for key in drop:
        cfg.pop(key, None)
    cfg.update(changes)
    (out_dir / "config.json").write_text(json.dumps(cfg))
    return out_dir


@pytest.mark.parametrize("family", GEMMAS)
def test_every_position_logits_match_transformers(hf_model_dirs, tmp_path, family):
    """50 positions through local layers (window 8) and global ones; the final soft-cap bites (the
    uncapped logits pass 3), and so do the window and Gemma 2's attention soft-cap: transformers
    without either gives other logits than the ones matched here."""
    model_dir = hf_model_dirs[family]
    ids = random_prompts(1, VOCAB, 50, 50, seed=3)[0]
    want = hf_logits(model_dir, ids)
    got = llmctl_logits(model_dir, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert got.abs().max() < 3.0
    hf = hf_model(model_dir)
    with torch.inference_mode():
        uncapped = hf.lm_head(hf.model(torch.tensor([ids])).last_hidden_state)[0]
    assert uncapped.abs().max() > 4.0
    loosened = {"sliding_window": 4096}
    if family == "gemma2":
        loosened["attn_logit_softcapping"] = None
    for key, value in loosened.items():
        other = hf_logits(variant(model_dir, tmp_path / key, **{key: value}), ids)
        assert (other - want).abs().max() > 1e-3, f"{key} does not change the logits: the test cannot see it"


@pytest.mark.parametrize("family", GEMMAS)
def test_long_prompts_far_past_the_window_match_transformers(hf_model_dirs, family):
    """Prompts of 12 to 25 windows, prefilled in 32-token chunks next to decodes, then 20 decode steps."""
    model_dir = hf_model_dirs[family]
    prompts = random_prompts(3, VOCAB, 100, 200, seed=5)
    expected = hf_greedy(model_dir, prompts, 20)
    engine = make_engine(model_dir, max_num_batched_tokens=32)
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("family", GEMMAS)
def test_shared_prefix_from_the_cache_matches_transformers(hf_model_dirs, family):
    """A 70-token system prompt (4 cached blocks, far more than the window) shared by later requests:
    their chunks attend over cached blocks, the local layers only to the last 8 positions."""
    model_dir = hf_model_dirs[family]
    system = random_prompts(1, VOCAB, 70, 70, seed=11)[0]
    prompts = [system + suffix for suffix in random_prompts(4, VOCAB, 1, 20, seed=12)]
    expected = hf_greedy(model_dir, prompts, 12)
    engine = make_engine(model_dir, enable_prefix_caching=True, max_num_batched_tokens=32, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outputs = [engine.generate([prompt], params)[0] for prompt in prompts]  # one after the other: later ones hit
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.num_cached_tokens for o in outputs] == [0, 64, 64, 64]
    hf = hf_model(model_dir)
    for prompt, out in zip(prompts, outputs):
        tokens = out.outputs[0].token_ids
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), want, rtol=0, atol=1e-4)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_gemma2_defaults_match_transformers(hf_model_dirs, tmp_path):
    """A config.json without layer_types, soft-caps, query_pre_attn_scalar, tie_word_embeddings or
    max_position_embeddings means Gemma2Config's: every other layer local from the first, soft-caps
    50 and 30, scale 256 ** -0.5, tied, 8192."""
    dropped = (
        "layer_types",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "query_pre_attn_scalar",
        "tie_word_embeddings",
        "max_position_embeddings",
    )
    model_dir = variant(hf_model_dirs["gemma2"], tmp_path / "gemma2", drop=dropped)
    settings = gemma_settings(ModelConfig.from_dir(model_dir))
    assert settings.layer_types == (SLIDING, FULL, SLIDING)
    assert (settings.attn_logit_softcap, settings.final_logit_softcap) == (50.0, 30.0)
    assert settings.attention_scale == 256**-0.5
    ids = random_prompts(1, VOCAB, 40, 40, seed=4)[0]
    torch.testing.assert_close(llmctl_logits(model_dir, ids), hf_logits(model_dir, ids), rtol=0, atol=2e-5)


def test_gemma3_transformers4_config_keys_and_defaults(hf_model_dirs, tmp_path):
    """Gemma 3 as transformers 4 wrote it (``rope_theta`` + ``rope_scaling`` for global layers,
    ``rope_local_base_freq`` for local ones, ``sliding_window_pattern`` instead of layer_types) runs
    the same model; and without any of them, Gemma3TextConfig's defaults (bases 1e6 and 1e4, five
    local layers in six: all three local here) as transformers reads them."""
    source = hf_model_dirs["gemma3"]
    ids = random_prompts(1, VOCAB, 40, 40, seed=6)[0]
    legacy = variant(
        source,
        tmp_path / "legacy",
        drop=("rope_parameters", "layer_types", "_sliding_window_pattern"),
        rope_theta=5000.0,
        rope_scaling={"type": "linear", "factor": 4.0},
        rope_local_base_freq=100.0,
        sliding_window_pattern=2,  # local, global, local: the factory's layer_types
    )
    assert gemma_settings(ModelConfig.from_dir(legacy)).layer_types == (SLIDING, FULL, SLIDING)
    torch.testing.assert_close(llmctl_logits(legacy, ids), llmctl_logits(source, ids), rtol=0, atol=0)
    bare = variant(source, tmp_path / "bare", drop=("rope_parameters", "layer_types", "final_logit_softcapping"))
    settings = gemma_settings(ModelConfig.from_dir(bare))
    assert settings.layer_types == (SLIDING,) * 3 and settings.final_logit_softcap is None
    assert settings.local_rope_theta == 10_000.0
    assert ModelConfig.from_dir(bare).rope_theta == 10_000.0  # config parsing's; the model's global base is 1e6
    model = build_model(ModelConfig.from_dir(bare), dtype=torch.float32, device=torch.device("cpu"), ops=TorchOps())
    assert model.config.rope_theta == 1_000_000.0 and model.config.rope_scaling is None
    torch.testing.assert_close(llmctl_logits(bare, ids), hf_logits(bare, ids), rtol=0, atol=2e-5)


def test_gemma3_layers_rotate_with_their_own_base(hf_model_dirs):
    model = load_model(hf_model_dirs["gemma3"], dtype="float32", device=torch.device("cpu"), ops=TorchOps())
    local, global_, local2 = (layer.self_attn.rotary_emb for layer in model.model.layers)
    assert local is local2 and local is not global_
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 32, 2).float() / 32))
    torch.testing.assert_close(local.cos_sin_cache[7, :16], (7 * inv_freq).cos(), rtol=0, atol=0)
    inv_freq = 1.0 / (5000.0 ** (torch.arange(0, 32, 2).float() / 32)) / 4.0
    torch.testing.assert_close(global_.cos_sin_cache[7, :16], (7 * inv_freq).cos(), rtol=0, atol=0)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [8, None, 8] == [model.config.layer_window(i) for i in range(3)]
    assert {layer.self_attn.attn.logit_softcap for layer in model.model.layers} == {None}


def _gemma1_dir(out_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM, GemmaConfig

    torch.manual_seed(2)
    config = GemmaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        hidden_act="gelu",  # the legacy value of Google's checkpoints: GeLU-tanh
        max_position_embeddings=512,
        initializer_range=0.15,
        rms_norm_eps=1e-3,
        rope_theta=300.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(out_dir)
    return out_dir


def test_gemma1_matches_transformers(tmp_path):
    model_dir = _gemma1_dir(tmp_path / "gemma")
    ids = random_prompts(1, VOCAB, 40, 40, seed=8)[0]
    torch.testing.assert_close(llmctl_logits(model_dir, ids), hf_logits(model_dir, ids), rtol=0, atol=2e-5)
    prompts = random_prompts(4, VOCAB, 1, 40, seed=9)
    expected = hf_greedy(model_dir, prompts, 16)
    outputs = make_engine(model_dir).generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_geglu_are_transformers_bit_for_bit(dtype):
    from transformers.activations import ACT2FN
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    torch.manual_seed(0)
    hf = Gemma3RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        hf.weight.normal_(0.0, 0.5)
    hf = hf.to(dtype)
    ours = GemmaRMSNorm(96, 1e-6, dtype=dtype, ops=TorchOps(native_cpu=True))
    ours.weight.data.copy_(hf.weight)
    x, residual = (torch.randn(13, 96) * 4).to(dtype), torch.randn(13, 96).to(dtype)
    normed, stream = ours(x, residual)
    assert torch.equal(stream, residual + x)
    assert torch.equal(normed, hf(residual + x))
    assert torch.equal(ours(x)[0], hf(x))
    gate_up = (torch.randn(13, 2 * 80) * 3).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    want = ACT2FN["gelu_pytorch_tanh"](gate) * up
    for ops in (TorchOps(), TorchOps(native_cpu=True)):
        assert torch.equal(ops.gelu_tanh_and_mul(gate_up), want)


@pytest.mark.parametrize(
    ("family", "reason"),
    [
        ("gemma2", "Gemma2ForCausalLM's (1 + w) RMSNorms, GeGLU and soft-capping"),
        ("gemma3", "Gemma3ForCausalLM's (1 + w) RMSNorms, GeGLU and two rotary bases"),
    ],
)
def test_decodes_on_the_module_path_and_says_why(hf_model_dirs, monkeypatch, family, reason):
    """The native decode loop has no Gemma norm, GeGLU, window or soft-cap: Gemma decodes through the
    modules, and wherever the loop would otherwise run the start-up line names the reason."""
    monkeypatch.setenv("LLMCTL_DECODE_LOOP", "1")
    engine = make_engine(hf_model_dirs[family])
    assert engine.runner.native_decode is None
    if engine.model.model.norm.ops.kernels.decode_loop_why_not() is None:  # the kernels would take it
        assert engine.runner.decode_path == f"decode: Python modules ({reason})"


def _multimodal_gemma3(out_dir: Path) -> Path:
    """A tiny Gemma3ForConditionalGeneration (SigLIP tower, projector, the text model of
    tests/model_factory.py's gemma3) as transformers saves it: ``language_model.model.*`` beside
    ``vision_tower.*`` and ``multi_modal_projector.*``, the text config nested."""
    from model_factory import make_config
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    torch.manual_seed(5)
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8
    )
    config = Gemma3Config(
        text_config=make_config("gemma3").to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=VOCAB - 3,
        boi_token_index=VOCAB - 2,
        eoi_token_index=VOCAB - 1,
    )
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(out_dir)
    return out_dir


def test_the_text_model_of_a_multimodal_gemma3_checkpoint_matches_transformers(tmp_path):
    """Gemma 3 4B/12B/27B ship as Gemma3ForConditionalGeneration: llmctl runs the text model from
    the same files (the vision tower is not read) and generates what transformers' multimodal
    model generates from text alone."""
    from transformers import Gemma3ForConditionalGeneration

    model_dir = _multimodal_gemma3(tmp_path / "g3mm")
    cfg = ModelConfig.from_dir(model_dir)
    assert (cfg.architecture, cfg.family) == ("Gemma3ForCausalLM", "gemma3_text")
    prompts = random_prompts(3, VOCAB - 3, 4, 30, seed=11)
    hf = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    want = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
            want.append(out[0, len(prompt) :].tolist())
    engine = make_engine(model_dir)
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == want


def test_bidirectional_and_non_gelu_gemma_are_refused_by_name():
    tiny = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2}
    with pytest.raises(ModelLoadError, match="Gemma3ForConditionalGeneration without a text_config"):
        ModelConfig.from_dict({"architectures": ["Gemma3ForConditionalGeneration"], **tiny})
    cfg = ModelConfig.from_dict(
        {"architectures": ["Gemma3ForCausalLM"], "num_attention_heads": 2, "use_bidirectional_attention": True, **tiny}
    )
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        build_model(cfg, dtype=torch.float32, device=torch.device("cpu"), ops=TorchOps())
    cfg = ModelConfig.from_dict(
        {"architectures": ["Gemma2ForCausalLM"], "num_attention_heads": 2, "hidden_activation": "relu", **tiny}
    )
    with pytest.raises(UnsupportedModelError, match="'relu'"):
        build_model(cfg, dtype=torch.float32, device=torch.device("cpu"), ops=TorchOps())


def test_registry_entries_share_one_implementation():
    entries = [registry.family_for(a) for a in ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")]
    assert {family.model_class().__name__ for family in entries} == {"GemmaForCausalLM"}
    assert all(family.native_decode_why_not for family in entries)
    assert registry.family_for_model_type("gemma3_text") is entries[2]


@pytest.mark.slow
def test_triton_backend_matches_transformers(tmp_path):
    """The Triton kernels (here in Triton's interpreter) with Gemma 2's window and soft-cap: a prompt
    past the window, then decodes; a smaller model keeps the interpreter quick."""
    model_dir = make_hf_model("gemma2", tmp_path / "gemma2", seed=4, num_hidden_layers=2, layer_types=None)
    prompts = random_prompts(2, VOCAB, 12, 30, seed=13)
    expected = hf_greedy(model_dir, prompts, 6)
    engine = make_engine(model_dir, kernel_backend="triton", max_num_batched_tokens=16)
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected
