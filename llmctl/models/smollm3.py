"""Hugging Face SmolLM3 (transformers' ``SmolLM3ForCausalLM``): Llama's blocks, except that some
layers attend without the rotary embedding (NoPE). Which ones, as transformers' SmolLM3Config
derives it: ``no_rope_layers[i]`` (1: rotary, 0: none), or when config.json has no list, every
``no_rope_layer_interval``-th layer (default 4: layers 3, 7, 11, ...) goes without. Also as there:
``o_proj`` carries a bias when ``attention_bias`` does, and a config.json that leaves them out gets
SmolLM3's defaults (rope base 2,000,000, tied embeddings). Sliding windows (``use_sliding_window``)
are off in SmolLM3's checkpoints; the config parsing handles the field as for Mistral."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from llmctl.distributed import PipelineStage, TensorParallel
from llmctl.errors import ModelLoadError
from llmctl.layers.linear import LinearMethod, RowParallelLinear
from llmctl.layers.norm import RMSNorm
from llmctl.layers.ops import AttentionMetadata, TorchOps
from llmctl.layers.rotary import RotaryEmbedding
from llmctl.models.config import ModelConfig
from llmctl.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

_DEFAULT_ROPE_THETA = 2_000_000.0  # SmolLM3Config.default_theta
_DEFAULT_NO_ROPE_INTERVAL = 4


def rope_layers(cfg: ModelConfig) -> list[bool]:
    """For each layer, whether it applies the rotary embedding (SmolLM3Config's ``no_rope_layers``)."""
    flags = cfg.raw.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.raw.get("no_rope_layer_interval", _DEFAULT_NO_ROPE_INTERVAL))
        return [(i + 1) % interval != 0 for i in range(cfg.num_layers)]
    if len(flags) < cfg.num_layers:
        raise ModelLoadError(f"config.json: no_rope_layers has {len(flags)} entries for {cfg.num_layers} layers")
    return [bool(flag) for flag in flags[: cfg.num_layers]]


class SmolLM3Attention(LlamaAttention):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: TensorParallel,
        ops: TorchOps,
        method: LinearMethod | None,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__(cfg, dtype, tp, ops, method, rotary_emb)
        self.use_rope = True  # SmolLM3Model sets each layer's
        if cfg.attention_bias:  # transformers gives o_proj the q/k/v projections' bias setting
            self.o_proj = RowParallelLinear(
                cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=True, dtype=dtype, tp=tp, method=method
            )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.use_rope:
            return super().forward(positions, hidden, meta)
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split_with_sizes(self.qkv_proj.part_sizes, -1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, meta))


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: TensorParallel,
        ops: TorchOps,
        method: LinearMethod | None,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        nn.Module.__init__(self)  # LlamaDecoderLayer's parts, with this family's attention
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.self_attn = SmolLM3Attention(cfg, dtype, tp, ops, method, rotary_emb)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.mlp = LlamaMLP(cfg, dtype, tp, ops, method)


class SmolLM3Model(LlamaModel):
    decoder_layer_cls = SmolLM3DecoderLayer

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: TensorParallel,
        ops: TorchOps,
        method: LinearMethod | None,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__(cfg, dtype, tp, ops, method, stage)
        for layer, use_rope in zip(self.layers, rope_layers(cfg), strict=True):
            if isinstance(layer, SmolLM3DecoderLayer):
                layer.self_attn.use_rope = use_rope


class SmolLM3ForCausalLM(LlamaForCausalLM):
    model_cls = SmolLM3Model

    def __init__(self, cfg: ModelConfig, **kwargs) -> None:
        raw = cfg.raw
        rope_parameters = raw.get("rope_parameters") or {}
        defaults = {}
        if "rope_theta" not in raw and "rope_theta" not in rope_parameters:
            defaults["rope_theta"] = _DEFAULT_ROPE_THETA
        if "tie_word_embeddings" not in raw:
            defaults["tie_word_embeddings"] = True
        super().__init__(dataclasses.replace(cfg, **defaults) if defaults else cfg, **kwargs)
