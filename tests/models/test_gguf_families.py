"""GGUF files of every family llama.cpp's own converter writes (tests/llama_cpp_converter.py), each
from the tiny random checkpoint ``model_factory.make_hf_model`` builds (Gemma 1: built here), with
the values the file cannot hold set to what llama.cpp assumes (below). F32 runs token for token as
transformers on the checkpoint; Q8_0, dequantized and kept packed, as transformers on the weights
the file dequantizes to.

What the files cannot hold, so the checkpoints keep llama.cpp's fixed value: SmolLM3's layers
without rotary embedding (every 4th), Gemma 2's and 3's ``query_pre_attn_scalar`` (head_dim below
27B) and layer types (every 2nd / 6th layer global), Gemma 1's and 2's rotary base (10,000)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from llama_cpp_converter import convert, write_llama_tokenizer, write_sentencepiece_tokenizer
from model_factory import hf_greedy, make_config, make_hf_model

from llmctl.engine.llm_engine import LLMEngine
from llmctl.models.gguf import (
    _hf_name,
    _unpermute_order,
    config_tensors_of,
    gguf_config_dict,
    read_metadata,
)
from llmctl.models.gguf_reader import read_gguf
from llmctl.models.registry import family_for_gguf
from llmctl.sampling_params import SamplingParams

PROMPTS = [[5], list(range(10, 30)), list(range(40, 110))]  # past Phi-3's original 32 positions, Gemma's window 8

# GGUF architecture -> (model_factory family, overrides, tokenizer, pre-tokenizer name for BPE converters)
CASES = {
    "granite": ("granite", {}, "llama", None),
    "smollm3": ("smollm3", {"num_hidden_layers": 4, "no_rope_layers": None}, "llama", None),
    "olmo2": ("olmo2", {}, "llama", "gpt2"),
    "phi3": ("phi3", {}, "sentencepiece", None),
    "gemma": ("gemma", {}, "sentencepiece", None),
    "gemma2": (
        "gemma2",
        {"layer_types": None, "query_pre_attn_scalar": 32, "rope_theta": 10000.0},
        "sentencepiece",
        None,
    ),
    "gemma3": (
        "gemma3",
        {"num_hidden_layers": 6, "layer_types": None, "query_pre_attn_scalar": 32},
        "sentencepiece",
        None,
    ),
}
VOCAB = make_config("llama").vocab_size


def _gemma1_dir(out_dir: Path, seed: int) -> Path:
    from transformers import AutoModelForCausalLM, GemmaConfig

    torch.manual_seed(seed)
    config = GemmaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        initializer_range=0.15,
        rms_norm_eps=1e-3,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's norms scale by 1 + w and start at w = 0
                param.normal_(0.0, 0.5)
    model.save_pretrained(out_dir)
    return out_dir


_converted: dict[str, dict[str, Path]] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf_families")


def converted(arch: str, root: Path) -> dict[str, Path]:
    """The checkpoint and its F32 and Q8_0 files, made once per module."""
    if arch not in _converted or not _converted[arch]["hf"].is_dir():
        family, overrides, tokenizer, pre = CASES[arch]
        seed = 30 + list(CASES).index(arch)
        if family == "gemma":
            model_dir = _gemma1_dir(root / arch, seed)
        else:
            model_dir = make_hf_model(family, root / arch, seed=seed, **overrides)
        if tokenizer == "llama":
            write_llama_tokenizer(model_dir, VOCAB)
        else:
            write_sentencepiece_tokenizer(model_dir, VOCAB)
        files = {"hf": model_dir}
        for outtype in ("f32", "q8_0"):
            files[outtype] = convert(model_dir, root / f"{arch}-{outtype}.gguf", outtype, pre_tokenizer=pre)
        _converted[arch] = files
    return _converted[arch]


def _greedy(model: Path, n: int = 20, **kw) -> list[list[int]]:
    engine = LLMEngine(model=str(model), skip_tokenizer=True, dtype="float32", kv_cache_memory=8 << 20, **kw)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [out.outputs[0].token_ids for out in engine.generate(PROMPTS, params)]


def _logprobs_vs_transformers(gguf_file: Path, hf_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen tokens' log-probabilities from llmctl on the file and from transformers on the
    checkpoint (greedy tokens hide what keeps the argmax: Gemma's final soft-cap, for one)."""
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[-1]
    engine = LLMEngine(model=str(gguf_file), skip_tokenizer=True, dtype="float32", kv_cache_memory=8 << 20)
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0))
    tokens = out.outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return torch.tensor(out.outputs[0].logprobs), want


def _dequantized_checkpoint(gguf_path: Path, hf_dir: Path, out_dir: Path) -> Path:
    """The HF checkpoint with every weight replaced by the GGUF file's dequantized tensor, put back
    as the family's checkpoint holds it (Q/K order, norm offset)."""
    from gguf import dequantize
    from transformers import AutoModelForCausalLM

    reader = read_gguf(gguf_path)
    family = family_for_gguf(str(read_metadata(reader, gguf_path)["general.architecture"]))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg = model.config
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    params = dict(model.named_parameters())
    loaded = set()
    with torch.no_grad():
        for tensor in reader.tensors:
            name = _hf_name(tensor.name, family.gguf_architecture)
            if name is None:
                continue
            values = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
            values = values.reshape(params[name].shape)
            proj = name.split(".")[-2]
            if family.gguf_interleaved_qk and proj in heads:
                values = values[_unpermute_order(values.shape[0], heads[proj])]
            if name.endswith("norm.weight"):
                values = values - family.gguf_norm_offset
            params[name].copy_(values)
            loaded.add(name)
    assert loaded == set(params), set(params) - loaded
    model.save_pretrained(out_dir)
    return out_dir


@pytest.mark.parametrize("arch", list(CASES))
def test_f32_file_matches_transformers(arch, root):
    files = converted(arch, root)
    assert _greedy(files["f32"]) == hf_greedy(files["hf"], PROMPTS, 20)


@pytest.mark.parametrize("arch", list(CASES))
def test_f32_file_logprobs_match_transformers(arch, root):
    files = converted(arch, root)
    torch.testing.assert_close(*_logprobs_vs_transformers(files["f32"], files["hf"]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", list(CASES))
def test_q8_0_file_matches_transformers_on_its_dequantized_weights(arch, root, tmp_path):
    files = converted(arch, root)
    types = {t.tensor_type.name for t in read_gguf(files["q8_0"]).tensors}
    assert "Q8_0" in types
    reference = _dequantized_checkpoint(files["q8_0"], files["hf"], tmp_path / "dequantized")
    want = hf_greedy(reference, PROMPTS, 20)
    assert _greedy(files["q8_0"], quantization="none") == want
    assert _greedy(files["q8_0"]) == want  # kept packed, computed by the int8 kernels


def _config_of(path: Path) -> dict:
    reader = read_gguf(path)
    meta = read_metadata(reader, path)
    return gguf_config_dict(meta, {t.name for t in reader.tensors}, path, config_tensors=config_tensors_of(reader))


def test_granite_multipliers_come_from_the_file(root):
    cfg = _config_of(converted("granite", root)["f32"])
    want = make_config("granite")
    assert (cfg["embedding_multiplier"], cfg["residual_multiplier"]) == (12.0, pytest.approx(0.22))
    assert (cfg["attention_multiplier"], cfg["logits_scaling"]) == (want.attention_multiplier, 8.0)


def test_granite_without_attention_scale_uses_llama_cpps_default():
    meta = {
        "general.architecture": "granite",
        "granite.attention.head_count": 4,
        "granite.embedding_length": 64,
        "granite.feed_forward_length": 160,
        "granite.block_count": 2,
        "granite.context_length": 512,
        "granite.attention.layer_norm_rms_epsilon": 1e-5,
        "granite.vocab_size": 320,
    }
    cfg = gguf_config_dict(meta, {"output.weight"}, Path("g.gguf"))
    assert cfg["attention_multiplier"] == 16**-0.5
    assert "embedding_multiplier" not in cfg  # GraniteConfig's default 1.0, as llama.cpp


def test_gemma_norms_are_stored_plus_one(root):
    """llama.cpp's Gemma converters store 1 + w for every norm weight; the loader takes it off."""
    from safetensors.torch import load_file

    files = converted("gemma3", root)
    stored = {t.name: np.array(t.data) for t in read_gguf(files["f32"]).tensors}
    hf = load_file(files["hf"] / "model.safetensors")
    for gguf_name, hf_name in [
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.1.attn_q_norm.weight", "model.layers.1.self_attn.q_norm.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ]:
        assert np.array_equal(stored[gguf_name], (hf[hf_name] + 1).numpy())


def test_gemma3_config_from_the_file(root):
    cfg = _config_of(converted("gemma3", root)["f32"])
    assert cfg["rope_theta"] == 5000.0 and cfg["rope_local_base_freq"] == 100.0
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert (cfg["query_pre_attn_scalar"], cfg["sliding_window"], cfg["final_logit_softcapping"]) == (32, 8, 3.0)


def test_gemma_27b_attention_scale_follows_llama_cpp():
    from llmctl.models.gemma import gemma_gguf_config

    for arch, layers in (("Gemma2ForCausalLM", 46), ("Gemma3ForCausalLM", 62)):
        cfg = {"architectures": [arch], "num_hidden_layers": layers, "hidden_size": 4608, "num_attention_heads": 32}
        big = {**cfg, "head_dim": 128, "sliding_window": 4096}
        gemma_gguf_config(big, None, {})
        assert big["query_pre_attn_scalar"] == 144
        small = {**cfg, "num_hidden_layers": layers - 4, "head_dim": 256, "sliding_window": 4096}
        gemma_gguf_config(small, None, {})
        assert small["query_pre_attn_scalar"] == 256


def test_phi3_longrope_comes_from_the_factor_tensors(root):
    path = converted("phi3", root)["f32"]
    names = {t.name for t in read_gguf(path).tensors}
    assert {"rope_factors_long.weight", "rope_factors_short.weight", "blk.0.attn_qkv.weight"} <= names
    cfg = _config_of(path)
    scaling = make_config("phi3").rope_scaling
    assert cfg["rope_scaling"] == {
        "rope_type": "longrope",
        "long_factor": scaling["long_factor"],
        "short_factor": scaling["short_factor"],
    }
    assert (cfg["partial_rotary_factor"], cfg["original_max_position_embeddings"]) == (0.75, 32)
    assert cfg["sliding_window"] is None  # written as 0


def test_olmo2_has_post_norms_and_full_width_qk_norms(root):
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in read_gguf(converted("olmo2", root)["f32"]).tensors}
    assert shapes["blk.0.attn_q_norm.weight"] == (64,) and shapes["blk.0.attn_k_norm.weight"] == (32,)
    assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"} <= set(shapes)
    assert "blk.0.attn_norm.weight" not in shapes
