"""The Llama family in one implementation: Llama 2/3, Mistral, Qwen2 (q/k/v bias) and Qwen3
(per-head q/k RMSNorm), and the base that close relatives (granite.py) subclass. Module names
mirror Hugging Face's so checkpoints load by name."""

from __future__ import annotations

import torch
from torch import nn

from llmctl.distributed import PipelineStage, TensorParallel
from llmctl.layers.attention import Attention
from llmctl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from llmctl.layers.linear import LinearMethod, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmctl.layers.norm import RMSNorm
from llmctl.layers.ops import AttentionMetadata, TorchOps
from llmctl.layers.rotary import RotaryEmbedding
from llmctl.models.config import ModelConfig

StageOutput = tuple[torch.Tensor, torch.Tensor]  # (hidden, residual) handed to the next pipeline stage


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: TensorParallel,
        ops: TorchOps,
        method: LinearMethod | None,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            bias=cfg.attention_bias,
            dtype=dtype,
            tp=tp,
            method=method,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False, dtype=dtype, tp=tp, method=method
        )
        self.rotary_emb = rotary_emb  # one table shared by every layer
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, ops=ops)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.qk_norm = cfg.qk_norm
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5, ops=ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        # split_with_sizes on sizes fixed at construction: Tensor.split's Python wrapper costs more
        # than the split at decode sizes, 30 times a step.
        q, k, v = self.qkv_proj(hidden).split_with_sizes(self.qkv_proj.part_sizes, -1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q.flatten(0, 1))[0].view_as(q)
            k = self.k_norm(k.flatten(0, 1))[0].view_as(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel, ops: TorchOps, method: LinearMethod | None
    ) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias, dtype=dtype, tp=tp, method=method
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype, tp=tp, method=method
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: TensorParallel,
        ops: TorchOps,
        method: LinearMethod | None,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.self_attn = LlamaAttention(cfg, dtype, tp, ops, method, rotary_emb)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.mlp = LlamaMLP(cfg, dtype, tp, ops, method)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    # a family's subclass may swap in its own
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    embedding_cls: type[VocabParallelEmbedding] = VocabParallelEmbedding

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: TensorParallel,
        ops: TorchOps,
        method: LinearMethod | None,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        # A pipeline stage builds only its own layers; the others are empty placeholders, so that
        # checkpoint names (model.layers.<i>) keep their global index.
        self.stage = stage or PipelineStage.whole(cfg.num_layers)
        self.embed_tokens = self.embedding_cls(cfg.vocab_size, cfg.hidden_size, dtype=dtype, tp=tp)
        rotary = {  # one table per layer type whose rope differs (config.json's layer_rope)
            kind: RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, *cfg.rope_for(kind), ops=ops)
            for kind in {"full_attention", *cfg.layer_rope}
        }
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(cfg, dtype, tp, ops, method, rotary.get(kind, rotary["full_attention"]))
            if self.stage.owns_layer(i)
            else nn.Identity()
            for i, kind in enumerate(cfg.layer_types)
        )
        for i, layer in enumerate(self.layers):  # each layer's sliding window, from cfg.layer_types
            attn = getattr(getattr(layer, "self_attn", None), "attn", None)
            if isinstance(attn, Attention) and attn.sliding_window is None:  # a subclass may have set its own
                attn.sliding_window = cfg.layer_window(i)
        self.stage_layers = list(self.layers)[self.stage.start : self.stage.end]  # a plain list: no per-step slicing
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: StageOutput | None = None,
    ) -> torch.Tensor | StageOutput:
        """The final hidden states; a pipeline stage other than the last returns ``(hidden, residual)``
        for the next stage, and a stage other than the first starts from the previous one's."""
        hidden, residual = (self.embed_tokens(input_ids), None) if intermediate is None else intermediate
        for layer in self.stage_layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        if not self.stage.is_last:
            return hidden, residual
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    model_cls: type[LlamaModel] = LlamaModel  # a family's subclass may swap in its own
    # checkpoint projection name -> (merged module name, part id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype,
        ops: TorchOps,
        tp: TensorParallel = TensorParallel(),
        linear_method: LinearMethod | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_cls(cfg, dtype, tp, ops, linear_method, stage)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype, tp=tp)
        self.lm_head.logits_quantization = getattr(linear_method, "logits_quantization", None)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: StageOutput | None = None,
    ) -> torch.Tensor | StageOutput:
        return self.model(input_ids, positions, meta, intermediate)

    def process_weights_after_loading(self) -> None:
        """Final per-layer weight layouts (e.g. CPU prepacking), once every tensor is in place."""
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers if isinstance(layer, LlamaDecoderLayer)]

    def owns_checkpoint_tensor(self, name: str) -> bool:
        """False for another pipeline stage's decoder layer (``model.layers.<i>.*``)."""
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
            return self.model.stage.owns_layer(int(parts[2]))
        return True
