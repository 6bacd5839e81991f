"""Tiny random-weight Hugging Face models (saved with ``transformers``), the HF greedy oracle, and
requests joining an engine one per step."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "granite",
    "smollm3",
    "olmo2",
    "olmo3",
    "phi3",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "gpt_oss",
    "deepseek_v2_lite",
    "deepseek_v2",
)


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
    elif family == "smollm3":
        from transformers import SmolLM3Config

        cls = SmolLM3Config
        # the first and last of 3 layers without rotary embedding (SmolLM3's default: every 4th only)
        common.update(
            num_hidden_layers=3, no_rope_layers=[0, 1, 0], rope_theta=1000.0, rms_norm_eps=1e-3, pad_token_id=None
        )
    elif family == "olmo2":
        from transformers import Olmo2Config

        cls = Olmo2Config
        common["rms_norm_eps"] = 1e-2  # far from the default (1e-5) and from llmctl's fallback (1e-6)
    elif family == "olmo3":
        from transformers import Olmo3Config

        cls = Olmo3Config
        # a window shorter than the tests' prompts, local layers around a global one, and YaRN on the
        # global layer's rope only (transformers 5's rope_parameters per layer type)
        common.update(
            num_hidden_layers=3,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rms_norm_eps=1e-2,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
            pad_token_id=None,
        )
    elif family == "phi3":
        from transformers import Phi3Config

        cls = Phi3Config
        # LongRoPE with short and long factors far apart, an original context (32) that prompts and
        # generations cross, 3/4 of each head rotated (Phi-4-mini's partial rotary): 6 frequencies
        half = int(64 // 4 * 0.75) // 2
        common.update(
            partial_rotary_factor=0.75,
            original_max_position_embeddings=32,
            rope_theta=500.0,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.25 * i for i in range(half)],
                "long_factor": [3.0 + 2.0 * i for i in range(half)],
            },
            pad_token_id=None,
        )
    elif family == "gemma2":
        from transformers import Gemma2Config

        cls = Gemma2Config
        # a window (8) that the 1..60-token prompts cross, soft-caps that bite, a query_pre_attn_scalar
        # far from head_dim (and from 256), layer_types other than Gemma 2's alternation
        common.update(
            num_hidden_layers=3,
            head_dim=32,
            query_pre_attn_scalar=20,
            sliding_window=8,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            rope_theta=1000.0,
            rms_norm_eps=1e-3,
            tie_word_embeddings=True,
        )
    elif family == "gemma3":
        from transformers import Gemma3TextConfig

        cls = Gemma3TextConfig
        # as gemma2 (no attention soft-cap: Gemma 3 has none), plus q/k norms and distinct rotary
        # bases: linear scaling on the global layers, another base on the local ones
        common.update(
            num_hidden_layers=3,
            head_dim=32,
            query_pre_attn_scalar=20,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            final_logit_softcapping=3.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            rms_norm_eps=1e-3,
            tie_word_embeddings=True,
        )
    elif family == "mixtral":
        from transformers import MixtralConfig

        cls = MixtralConfig
        # 8 experts of 48, top-2 (Mixtral always renormalizes the two weights)
        common.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, rms_norm_eps=1e-3)
    elif family == "qwen2_moe":
        from transformers import Qwen2MoeConfig

        cls = Qwen2MoeConfig
        # a shared expert, a dense middle layer (mlp_only_layers), top-2 weights not renormalized
        common.update(
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
    elif family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        cls = Qwen3MoeConfig
        # per-head q/k norms, a dense last layer, top-2 of 8 renormalized
        common.update(
            num_hidden_layers=3,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            mlp_only_layers=[2],
            norm_topk_prob=True,
        )
    elif family == "olmoe":
        from transformers import OlmoeConfig

        cls = OlmoeConfig
        # q/k norms over the whole projection, q/k/v clipped where it bites, top-2 of 8 not renormalized
        common.update(
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=48,
            clip_qkv=1.5,
            rms_norm_eps=1e-2,
            pad_token_id=None,
        )
    elif family == "gpt_oss":
        from transformers import GptOssConfig

        cls = GptOssConfig
        # 4 layers alternating sliding (window 8, crossed by the 1..60-token prompts) and full, top-2
        # of 6 experts, a SwiGLU limit (1.0) and alpha (1.3) far from the defaults so the clamps bite,
        # YaRN over an original context (32) that prompts and generations cross; make_hf_model
        # draws sinks and biases far from their zero init
        common.update(
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=48,
            num_local_experts=6,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            swiglu_alpha=1.3,
            swiglu_limit=1.0,
            rms_norm_eps=1e-3,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000.0,
                "factor": 4.0,
                "beta_fast": 8.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
            },
            pad_token_id=None,
        )
    elif family.startswith("deepseek_v2"):
        from transformers import DeepseekV2Config

        cls = DeepseekV2Config
        # MLA over a latent of 32 + 16 (V2-Lite's shape: no q_lora_rank), a dense first layer, then
        # top-2 of 6 experts plus a shared one, weights scaled by 1.5
        common.update(
            num_hidden_layers=3,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=24,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            rms_norm_eps=1e-3,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
            pad_token_id=None,
        )
        if family == "deepseek_v2":
            # DeepSeek-V2's shape: q through a q_lora_rank bottleneck, group-limited routing (top-2 within
            # the best of 2 groups of 4 experts), two shared experts, YaRN over an original context (32)
            # that prompts and generations cross, with mscale != mscale_all_dim so that both the
            # rotary factor and the softmax scale move
            common.update(
                kv_lora_rank=16,
                q_lora_rank=24,
                v_head_dim=16,
                n_routed_experts=8,
                topk_method="group_limited_greedy",
                n_group=2,
                topk_group=1,
                n_shared_experts=2,
                max_position_embeddings=128,  # factor x original, as transformers expects of YaRN
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 1000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                    "beta_fast": 8.0,
                    "beta_slow": 1.0,
                    "mscale": 1.0,
                    "mscale_all_dim": 0.5,
                },
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
    if family.startswith("gemma"):  # Gemma's norms scale by 1 + w and start at w = 0: make w count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.5)
    if family == "gpt_oss":  # sinks near the attention logits, every bias (zero at init) drawn
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("sinks"):
                    param.normal_(0.5, 1.0)
                elif name.endswith("bias"):
                    param.normal_(0.0, 0.2)
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


def staggered(engine, prompts: list[list[int]], params) -> list[tuple[list[int], list[float]]]:
    """Requests joining one per step, so that each runs beside others at every stage: each one's
    tokens and their logprobs."""
    ids, results, pending = [], {}, list(prompts)
    while pending or engine.has_unfinished():
        if pending:
            ids.append(engine.add_request(pending.pop(0), params))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [results[i] for i in ids]


def round_trip(w: torch.Tensor, kind: str) -> torch.Tensor:
    """``w [N, K]`` as ``--quantization kind`` packs and computes it: zero columns up to whole
    groups, quantized, dequantized, the padding dropped (int8: per output channel, int4: groups of 64)."""
    from llmctl.layers.quantization import dequantize, quantize_int4, quantize_int8

    multiple = 32 if kind == "int8" else 64
    padded = F.pad(w, (0, -w.shape[1] % multiple))
    packed = quantize_int8(padded) if kind == "int8" else quantize_int4(padded, 64)
    return dequantize(packed).float()[:, : w.shape[1]]
