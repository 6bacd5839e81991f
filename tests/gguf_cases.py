"""One tiny random checkpoint per family llmctl reads from GGUF, and the files llama.cpp's own
converter writes from it (tests/llama_cpp_converter.py): the cases the GGUF tests and
benchmarks/gguf_vs_llama_cpp.py share.

Each checkpoint is ``model_factory.make_hf_model``'s (Gemma 1: built here), with what a GGUF file
cannot hold set to what llama.cpp assumes: SmolLM3's layers without rotary embedding (every 4th),
Gemma 2's and 3's ``query_pre_attn_scalar`` and layer types, Gemma 1's and 2's rotary base; for the
mixture-of-experts families every layer sparse (the converter maps no dense MLP of Qwen MoE), OLMoE
without ``clip_qkv``, with the RMSNorm epsilon its converter writes (1e-5) and no grouped KV heads,
gpt-oss with llama.cpp's fixed SwiGLU alpha and limit and YaRN's default (truncated) correction range.
A gpt-oss whose experts are MXFP4, as OpenAI's checkpoints store them, and its converted file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from llama_cpp_converter import convert, write_llama_tokenizer, write_sentencepiece_tokenizer
from model_factory import make_config, make_hf_model

from llmctl.models.mxfp4 import FP4_VALUES

VOCAB = make_config("llama").vocab_size
_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1000.0,
    "factor": 4.0,
    "beta_fast": 8.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 32,
}

# GGUF name of the case -> (model_factory family, overrides, tokenizer, pre-tokenizer for BPE converters)
CASES: dict[str, tuple[str, dict[str, Any], str, str | None]] = {
    "llama": ("llama", {}, "llama", None),  # Llama 3.1 rope scaling: the converter's rope_freqs.weight
    # transformers' Qwen2 tokenizer class adds <|endoftext|> to the vocabulary: one more row for it
    "qwen2": ("qwen2", {"vocab_size": VOCAB + 1}, "llama", "default"),
    "qwen3": ("qwen3", {"vocab_size": VOCAB + 1}, "llama", "default"),
    "granite": ("granite", {}, "llama", None),
    "smollm3": ("smollm3", {"num_hidden_layers": 4, "no_rope_layers": None}, "llama", None),
    "olmo2": ("olmo2", {}, "llama", "default"),
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
    "mixtral": ("mixtral", {}, "llama", None),
    "qwen2moe": ("qwen2_moe", {"mlp_only_layers": []}, "llama", "default"),
    "qwen3moe": ("qwen3_moe", {"mlp_only_layers": []}, "llama", "default"),
    # llama.cpp's OLMoE norms k over all heads' width: as many KV heads as heads, as OLMoE has
    "olmoe": ("olmoe", {"clip_qkv": None, "rms_norm_eps": 1e-5, "num_key_value_heads": 4}, "llama", "default"),
    "gpt-oss": (
        "gpt_oss",
        {"swiglu_alpha": 1.702, "swiglu_limit": 7.0, "rope_parameters": _GPT_OSS_ROPE},
        "llama",
        "default",
    ),
    # DeepSeek-V2's shape with what llama.cpp fixes: the latent norms' epsilon is rms_norm_eps (1e-6,
    # transformers' fixed one), routing greedy (llama.cpp ranks expert groups by their top two
    # scores, V2 by its best), the rotary mscale equal to mscale_all_dim (the file keeps only that)
    "deepseek2": (
        "deepseek_v2",
        {
            "rms_norm_eps": 1e-6,
            "topk_method": "greedy",
            "n_group": None,
            "topk_group": None,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 8.0,
                "beta_slow": 1.0,
                "mscale": 0.5,
                "mscale_all_dim": 0.5,
            },
        },
        "llama",
        "default",
    ),
}
DENSE = tuple(CASES)[:10]
MOE = tuple(CASES)[10:]


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


def checkpoint(case: str, root: Path) -> Path:
    """The case's transformers checkpoint with its tokenizer, under ``root`` (made once)."""
    family, overrides, tokenizer, _ = CASES[case]
    # the converter names the model after its folder, and llama.cpp gives a model named like Phi-3
    # the attributes of Phi-3's own special tokens, which the tiny vocabulary lacks
    model_dir = root / case.replace("phi3", "tiny-p3")
    if (model_dir / "config.json").is_file():
        return model_dir
    seed = 50 + list(CASES).index(case)
    if family == "gemma":
        _gemma1_dir(model_dir, seed)
    else:
        make_hf_model(family, model_dir, seed=seed, **dict(overrides))  # transformers edits dicts it is given
    if tokenizer == "llama":
        write_llama_tokenizer(model_dir, VOCAB)
    else:
        write_sentencepiece_tokenizer(model_dir, VOCAB)
    return model_dir


def gguf_file(case: str, outtype: str, root: Path) -> Path:
    """The converter's ``outtype`` (f32, q8_0, ...) file of the case's checkpoint (made once)."""
    out = root / f"{case}-{outtype}.gguf"
    if not out.is_file():
        convert(checkpoint(case, root), out, outtype, pre_tokenizer=CASES[case][3])
    return out


def _random_mxfp4(shape: tuple[int, ...], gen: torch.Generator):
    """Random MXFP4 ``(blocks [E, N, K/32, 16], scales [E, N, K/32])`` for a transformers-layout
    expert tensor ``[E, K, N]``, and the ``[E, K, N]`` values they stand for (exact in fp32)."""
    experts, k, n = shape
    codes = torch.randint(0, 16, (experts, n, k // 32, 32), generator=gen, dtype=torch.uint8)
    scales = torch.randint(121, 125, (experts, n, k // 32), generator=gen, dtype=torch.uint8)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float64)
    values = lut[codes.long()] * torch.exp2(scales.double() - 127)[..., None]
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scales, values.flatten(-2).transpose(1, 2).float()


def mxfp4_experts(model: torch.nn.Module, gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every expert projection of a transformers gpt-oss ``model`` set to random values that MXFP4
    holds exactly; each one's ``(blocks, scales)`` by checkpoint name."""
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                param = getattr(layer.mlp.experts, proj)
                blocks, scales, values = _random_mxfp4(tuple(param.shape), gen)
                param.copy_(values)
                packed[f"model.layers.{i}.mlp.experts.{proj}"] = (blocks, scales)
    return packed


def mxfp4_checkpoints(root: Path) -> tuple[Path, Path]:
    """A gpt-oss checkpoint whose experts MXFP4 holds exactly (``dense``) and the same as OpenAI's
    checkpoints store it (``*_blocks`` / ``*_scales``, ``quantization_config`` mxfp4)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    source = checkpoint("gpt-oss", root)
    dense, quantized = root / "gpt-oss-dense", root / "gpt-oss-mxfp4"
    if (quantized / "model.safetensors").is_file():
        return dense, quantized
    overrides = dict(CASES["gpt-oss"][1], intermediate_size=64)  # MXFP4 groups of 32 features
    model_dir = root / "gpt-oss-mxfp4-source"
    if not model_dir.is_dir():
        make_hf_model("gpt_oss", model_dir, seed=9, **overrides)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    packed = mxfp4_experts(model, torch.Generator().manual_seed(11))
    model.save_pretrained(dense)
    quantized.mkdir(exist_ok=True)
    for extra in source.glob("tokenizer*"):
        (dense / extra.name).write_bytes(extra.read_bytes())
        (quantized / extra.name).write_bytes(extra.read_bytes())
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (quantized / "config.json").write_text(json.dumps(config))
    tensors = load_file(dense / "model.safetensors")
    for name, (blocks, scales) in packed.items():
        del tensors[name]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    return dense, quantized


def mxfp4_gguf_file(root: Path) -> Path:
    """The converter's file of ``mxfp4_checkpoints``' MXFP4 checkpoint (experts stay MXFP4, the rest
    F32; made once)."""
    out = root / "gpt-oss-mxfp4.gguf"
    if not out.is_file():
        convert(mxfp4_checkpoints(root)[1], out, "f32", pre_tokenizer=CASES["gpt-oss"][3])
    return out


def mxfp4_dense_gguf_file(root: Path) -> Path:
    """The converter's F32 file of ``mxfp4_checkpoints``' dense twin: the same values (made once)."""
    out = root / "gpt-oss-mxfp4-dense-f32.gguf"
    if not out.is_file():
        convert(mxfp4_checkpoints(root)[0], out, "f32", pre_tokenizer=CASES["gpt-oss"][3])
    return out
