"""Tiny random-weight Hugging Face models (saved with ``transformers``) and the HF greedy oracle."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "granite")


def make_config(family: str, **overrides):
    from transformers import GraniteConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if family == "llama":
        common["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        cls = LlamaConfig
    elif family == "qwen2":
        cls = Qwen2Config
        common["tie_word_embeddings"] = True
    elif family == "qwen3":
        cls = Qwen3Config
        common["head_dim"] = 32  # != hidden / heads, as in real Qwen3 checkpoints
    elif family == "mistral":
        cls = MistralConfig
        common["sliding_window"] = None
    elif family == "granite":
        cls = GraniteConfig
        # every multiplier far from 1 (and the attention scale from 1/sqrt(head_dim) = 0.25), so a
        # misplaced one changes the tokens
        common.update(
            embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0
        )
    else:
        raise ValueError(family)
    common.update(overrides)
    return cls(**common)


def make_hf_model(family: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = make_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    return out_dir


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The oracle: transformers' own greedy generation, one prompt at a time, fp32 on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, EOS included
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def random_prompts(n: int, vocab: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for length in lengths]
