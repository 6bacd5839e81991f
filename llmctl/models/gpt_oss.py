"""gpt-oss (transformers' ``GptOssForCausalLM``): Llama's pre-norm decoder layer with

- attention sinks: a learned logit per query head (``self_attn.sinks``) that joins each softmax
  denominator, taking probability mass without contributing a value (llmctl/layers/attention.py;
  such layers run the torch attention references on every backend);
- q/k/v and o projections with biases (``attention_bias``, true by default), layers alternating
  sliding (``sliding_window``, 128 in the released checkpoints) and full attention by
  ``layer_types``, YaRN rotary embedding (llmctl/layers/rotary.py);
- a mixture-of-experts feed-forward on every layer (``mlp.router`` with a bias: top-k of the
  logits, softmax over those k; ``mlp.experts`` with biases and the clamped SwiGLU
  ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``), whose
  stacked tensors transformers stores transposed with gate and up in interleaved columns
  (llmctl/layers/moe.py loads them into its usual layout).

MXFP4 checkpoints (``quantization_config.quant_method: mxfp4``, the released ones) keep their
experts packed as int8 groups holding exactly the same values (llmctl/models/mxfp4.py), or with
``--quantization none`` dequantize them to the run dtype while loading. Defaults of fields a
config.json leaves out are ``GptOssConfig``'s. A GGUF file's experts (gate, up and down stacked
apart, with their biases; MXFP4 or another GGML type) stay packed the same way, or, dequantized,
become transformers' layout in ``gpt_oss_gguf_experts``, which also hands on the biases."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import torch
from torch import nn

from llmctl.distributed import PipelineStage, TensorParallel
from llmctl.layers.attention import Attention
from llmctl.layers.linear import LinearMethod, RowParallelLinear, copy_checked
from llmctl.layers.moe import Router, RouterSpec, StackedExperts, clamped_swiglu
from llmctl.layers.norm import RMSNorm
from llmctl.layers.ops import TorchOps
from llmctl.layers.quantization.methods import OnTheFlyQuantMethod
from llmctl.layers.rotary import RotaryEmbedding
from llmctl.models.config import ModelConfig
from llmctl.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from llmctl.models.moe_families import refuse_calibrated_experts, refuse_packed_experts_under_tp

# GptOssConfig's defaults for the fields below
_DEFAULTS = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "sliding_window": 128,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
}


class GptOssAttention(LlamaAttention):
    """Llama's attention with an o_proj bias and the per-head ``sinks``."""

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
        self.tp = tp
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias, dtype=dtype, tp=tp, method=method
        )
        # this rank's heads' sinks; the Attention below shares the parameter (checkpoint name: here)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5, ops=ops, sinks=self.sinks
        )

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        n = self.num_heads
        src = loaded.narrow(0, self.tp.rank * n, n) if self.tp.size > 1 else loaded
        copy_checked(param.data, src, "sinks")


class GptOssMLP(nn.Module):
    """transformers' ``GptOssMLP``: ``router`` and ``experts`` (module docstring), every token
    through its top-k experts; one all-reduce of the routed sum under tensor parallelism."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel, ops: TorchOps, method: LinearMethod | None
    ) -> None:
        super().__init__()
        raw = cfg.raw
        num_experts = int(raw.get("num_local_experts", raw.get("num_experts", _DEFAULTS["num_local_experts"])))
        spec = RouterSpec(
            num_experts,
            int(raw.get("num_experts_per_tok", _DEFAULTS["num_experts_per_tok"])),
            norm_topk_prob=False,
            scoring="topk_softmax",
        )
        self.tp = tp
        self.router = Router(cfg.hidden_size, spec, dtype=dtype, tp=tp, bias=True)
        act = functools.partial(
            clamped_swiglu,
            alpha=float(raw.get("swiglu_alpha", _DEFAULTS["swiglu_alpha"])),
            limit=float(raw.get("swiglu_limit", _DEFAULTS["swiglu_limit"])),
        )
        self.experts = StackedExperts(
            num_experts,
            cfg.hidden_size,
            cfg.intermediate_size,
            dtype=dtype,
            tp=tp,
            act=act,
            bias=True,
            concatenated=False,
            transposed=True,
            fused=ops.fused_experts,
            quant_method=method if isinstance(method, OnTheFlyQuantMethod) else None,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.tp.all_reduce(self.experts(x, weights, ids))


class GptOssDecoderLayer(LlamaDecoderLayer):
    """Llama's layer and forward with gpt-oss's attention and experts."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: TensorParallel,
        ops: TorchOps,
        method: LinearMethod | None,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.self_attn = GptOssAttention(cfg, dtype, tp, ops, method, rotary_emb)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.mlp = GptOssMLP(cfg, dtype, tp, ops, method)


class GptOssModel(LlamaModel):
    decoder_layer_cls = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    model_cls = GptOssModel

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        linear_method: LinearMethod | None = None,
        tp: TensorParallel = TensorParallel(),
        stage: PipelineStage | None = None,
        **kwargs,
    ) -> None:
        refuse_packed_experts_under_tp(cfg, linear_method, tp)
        super().__init__(gpt_oss_config(cfg), linear_method=linear_method, tp=tp, stage=stage, **kwargs)

    def process_weights_after_loading(self) -> None:
        refuse_calibrated_experts(self)
        super().process_weights_after_loading()


def gpt_oss_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with GptOssConfig's defaults where config.json leaves a field out (transformers
    writes them all; a hand-written config may not): RMSNorm epsilon, rotary base, the window and
    the alternation of sliding (even) and full (odd) layers."""
    raw, changes = cfg.raw, {}
    if "rms_norm_eps" not in raw:
        changes["rms_norm_eps"] = _DEFAULTS["rms_norm_eps"]
    if "rope_theta" not in raw and "rope_theta" not in (raw.get("rope_parameters") or {}):
        changes["rope_theta"] = _DEFAULTS["rope_theta"]
    if "sliding_window" not in raw:
        changes["sliding_window"] = _DEFAULTS["sliding_window"]
    if raw.get("layer_types") is None:
        changes["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_layers)
        ]
    return dataclasses.replace(cfg, **changes) if changes else cfg


def gpt_oss_gguf_experts(prefix: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """One layer's GGUF experts (gate and up ``[E, I, H]`` with ``[E, I]`` biases, down ``[E, H, I]``
    with ``[E, H]``) in transformers' ``GptOssExperts`` layout: ``gate_up_proj`` ``[E, H, 2 I]`` with
    gate and up in alternate columns, ``down_proj`` ``[E, I, H]``, and their biases. The biases
    alone where the weights were kept packed (llmctl/models/gguf.py)."""
    names = ("gate_proj", "up_proj", "down_proj")
    biases = {f"{n}.bias" for n in names}
    if set(parts) not in (biases, biases | {f"{n}.weight" for n in names}):
        raise ValueError(f"expected gate, up and down expert weights and biases, got {sorted(parts)}")
    if "gate_proj.weight" in parts:
        gate_up = torch.stack([parts["gate_proj.weight"], parts["up_proj.weight"]], dim=2).flatten(1, 2)
        yield f"{prefix}.experts.gate_up_proj", gate_up.transpose(1, 2)
        yield f"{prefix}.experts.down_proj", parts["down_proj.weight"].transpose(1, 2)
    gate_up_bias = torch.stack([parts["gate_proj.bias"], parts["up_proj.bias"]], dim=-1).flatten(1)
    yield f"{prefix}.experts.gate_up_proj_bias", gate_up_bias
    yield f"{prefix}.experts.down_proj_bias", parts["down_proj.bias"]
