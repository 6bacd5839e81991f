"""IBM Granite 3 (transformers' ``GraniteForCausalLM``): Llama's blocks with four scalars from
config.json, placed where transformers' modeling_granite.py places them: the token embeddings times
``embedding_multiplier``; each attention and MLP output times ``residual_multiplier`` before it
joins the residual stream; ``attention_multiplier`` as the attention scale (instead of
1/sqrt(head_dim)); the logits divided by ``logits_scaling``."""

from __future__ import annotations

from typing import Any

import torch

from llmctl.distributed import PipelineStage, TensorParallel
from llmctl.layers.embedding import VocabParallelEmbedding
from llmctl.layers.linear import LinearMethod
from llmctl.layers.ops import AttentionMetadata, TorchOps
from llmctl.layers.rotary import RotaryEmbedding
from llmctl.models.config import ModelConfig
from llmctl.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def _multiplier(cfg: ModelConfig, name: str) -> float:
    return float(cfg.raw.get(name, 1.0))  # GraniteConfig's default


def granite_gguf_config(cfg: dict[str, Any], field: Any, tensors: dict[str, list[float]]) -> None:
    """A GGUF file without ``granite.attention.scale`` (llama.cpp's converter writes each multiplier
    only when it is not zero) is read by llama.cpp with the scale 1/sqrt(head_dim), not GraniteConfig's
    default 1.0."""
    cfg.setdefault("attention_multiplier", cfg["head_dim"] ** -0.5)


class ScaledEmbedding(VocabParallelEmbedding):
    """Token embeddings times a constant, so that every caller of ``embed_tokens`` (the model, GPTQ
    calibration) sees the scaled rows; the stored weight stays the checkpoint's (the LM head may
    share it)."""

    multiplier: float = 1.0

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(token_ids) * self.multiplier


class GraniteDecoderLayer(LlamaDecoderLayer):
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
        self.self_attn.attn.scale = _multiplier(cfg, "attention_multiplier")
        self.residual_multiplier = _multiplier(cfg, "residual_multiplier")

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # the norms add their input to the residual stream, so a scaled output joins it scaled
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    decoder_layer_cls = GraniteDecoderLayer
    embedding_cls = ScaledEmbedding

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
        self.embed_tokens.multiplier = _multiplier(cfg, "embedding_multiplier")


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls = GraniteModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / _multiplier(self.config, "logits_scaling")
