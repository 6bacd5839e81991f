"""AI2's OLMo 2 (transformers' ``Olmo2ForCausalLM``): Llama's projections, MLP and rotary embedding
in another arrangement, as transformers' modeling_olmo2.py places them:

- no norm before attention or the MLP; each one's output is normed (``post_attention_layernorm``,
  ``post_feedforward_layernorm``) and then added to the residual stream;
- q and k are RMS-normed over the whole projection (``num_heads * head_dim`` values per token, one
  weight each), before the split into heads and the rotary embedding (Qwen3 norms each head);
- ``o_proj`` carries a bias when ``attention_bias`` does; a config.json without ``rms_norm_eps``
  gets OLMo 2's 1e-5.

Under tensor parallelism each rank holds some heads, so the q/k norms gather the whole projection,
norm it with the full weight (each rank keeps the whole vector) and keep this rank's slice: the same
arithmetic as one process."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from llmctl.distributed import TensorParallel
from llmctl.layers.linear import LinearMethod, RowParallelLinear
from llmctl.layers.norm import RMSNorm
from llmctl.layers.ops import AttentionMetadata, TorchOps
from llmctl.layers.rotary import RotaryEmbedding
from llmctl.models.config import ModelConfig
from llmctl.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

_DEFAULT_RMS_NORM_EPS = 1e-5  # Olmo2Config's


class Olmo2Attention(LlamaAttention):
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
        if cfg.attention_bias:  # transformers gives o_proj the q/k/v projections' bias setting
            self.o_proj = RowParallelLinear(
                cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=True, dtype=dtype, tp=tp, method=method
            )
        self.tp = tp
        self.q_norm = RMSNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.k_norm = RMSNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, ops=ops)

    def _norm_whole(self, x: torch.Tensor, norm: RMSNorm, replicas: int) -> torch.Tensor:
        """RMSNorm over the whole projection; ``x`` is this rank's slice of it (``replicas`` ranks
        hold each slice: KV heads are replicated when there are fewer than ranks)."""
        if self.tp.size == 1:
            return norm(x)[0]
        width = x.shape[-1]
        gathered = self.tp.all_gather(x)
        if replicas > 1:
            gathered = gathered.unflatten(-1, (self.tp.size, width))[:, ::replicas].flatten(1)
        slot = self.tp.rank // replicas
        return norm(gathered)[0][:, slot * width : (slot + 1) * width]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split_with_sizes(self.qkv_proj.part_sizes, -1)
        q = self._norm_whole(q, self.q_norm, 1).reshape(num_tokens, self.num_heads, self.head_dim)
        k = self._norm_whole(k, self.k_norm, self.qkv_proj.kv_replicas).reshape(
            num_tokens, self.num_kv_heads, self.head_dim
        )
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class Olmo2DecoderLayer(LlamaDecoderLayer):
    """Carries the residual stream as ``(hidden, residual)`` like the Llama layers (the stream is
    their sum; ``residual`` is None before the first layer), so the final norm and pipeline stages
    work unchanged: it returns the MLP's normed output and the stream before it."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: TensorParallel,
        ops: TorchOps,
        method: LinearMethod | None,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        nn.Module.__init__(self)  # no input_layernorm: LlamaDecoderLayer's parts are not all here
        self.self_attn = Olmo2Attention(cfg, dtype, tp, ops, method, rotary_emb)
        self.mlp = LlamaMLP(cfg, dtype, tp, ops, method)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else residual + hidden
        stream = stream + self.post_attention_layernorm(self.self_attn(positions, stream, meta))[0]
        return self.post_feedforward_layernorm(self.mlp(stream))[0], stream


class Olmo2Model(LlamaModel):
    decoder_layer_cls = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls = Olmo2Model

    def __init__(self, cfg: ModelConfig, **kwargs) -> None:
        if "rms_norm_eps" not in cfg.raw:
            cfg = dataclasses.replace(cfg, rms_norm_eps=_DEFAULT_RMS_NORM_EPS)
        super().__init__(cfg, **kwargs)
