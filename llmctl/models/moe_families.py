"""Mixture-of-experts families on the Llama blocks: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE
(transformers' ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``,
``OlmoeForCausalLM``). Each decoder layer is Llama's (norm, attention, norm, feed-forward, residual
adds), with a ``SparseMoeBlock`` (llmctl/layers/moe.py) as its feed-forward, or a dense MLP on the
layers the config keeps dense. What differs, as transformers' modeling files place it:

- Mixtral: top-k weights always renormalized and kept in fp32 while they scale the experts'
  outputs; a sliding window on every layer when ``sliding_window`` is set.
- Qwen2-MoE: a shared expert on every MoE layer (``shared_expert_intermediate_size``, scaled by
  ``sigmoid(shared_expert_gate(x))``); q/k/v biases from ``qkv_bias``; dense MLPs
  (``intermediate_size``) on ``mlp_only_layers`` and on layers ``i`` with ``(i + 1) %
  decoder_sparse_step != 0``; ``norm_topk_prob``.
- Qwen3-MoE: Qwen3's per-head q/k RMSNorm, the same dense-layer rules and ``norm_topk_prob``;
  o_proj carries a bias when ``attention_bias`` does.
- OLMoE: q and k RMS-normed over the whole projection (as OLMo 2, llmctl/models/olmo2.py) but
  with Llama's pre-norm layer; ``clip_qkv`` clamps q, k (after their norms) and v; o_proj bias
  with ``attention_bias``; ``norm_topk_prob``.

The experts' intermediate size is ``intermediate_size`` for Mixtral and OLMoE,
``moe_intermediate_size`` for the Qwen families. Defaults of fields a config.json leaves out are
transformers' configuration defaults. ``--quantization int8|int4|fp8`` on a float checkpoint
quantizes the attention and dense layers as any model's, and the experts, loaded as float, expert
by expert into packed experts after loading (``StackedExperts.quantize_experts``); the routers stay
float. Packed experts run with tensor parallel size 1, and ``--calibration`` (GPTQ) is refused:
its layer-by-layer pass rounds linear layers only, not the experts. A quantized GGUF file's
experts run packed too (llmctl/models/gguf.py).

GGUF files (llmctl/models/gguf.py) hold each layer's experts as three stacked tensors, which
``gguf_expert_tensors`` turns into transformers' stacked ones; ``moe_gguf_config`` fills in what
llama.cpp fixes per architecture rather than reading it from the file."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmctl.distributed import PipelineStage, TensorParallel
from llmctl.errors import ConfigError, UnsupportedModelError
from llmctl.layers.linear import LinearBase, LinearMethod, RowParallelLinear
from llmctl.layers.moe import RouterSpec, SparseMoeBlock, StackedExperts
from llmctl.layers.norm import RMSNorm
from llmctl.layers.ops import AttentionMetadata, TorchOps
from llmctl.layers.quantization.methods import OnTheFlyQuantMethod, PackedLinearMethod
from llmctl.layers.rotary import RotaryEmbedding
from llmctl.models.config import ModelConfig
from llmctl.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from llmctl.models.olmo2 import Olmo2Attention


@dataclass(frozen=True)
class MoeLayout:
    """Which layers have experts, and what each MoE block holds."""

    router: RouterSpec
    expert_intermediate_size: int
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    decoder_sparse_step: int = 1
    mlp_only_layers: frozenset[int] = frozenset()

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def moe_layout(cfg: ModelConfig) -> MoeLayout:
    """The layout from config.json, per family (``cfg.family`` is its ``model_type``)."""
    raw = cfg.raw
    if cfg.family == "mixtral":
        router = RouterSpec(
            int(raw.get("num_local_experts", 8)),
            int(raw.get("num_experts_per_tok", 2)),
            norm_topk_prob=True,
            weights_dtype="float32",
        )
        return MoeLayout(router, cfg.intermediate_size)
    defaults = {  # transformers' config defaults: experts, experts per token, their intermediate size
        "qwen2_moe": (60, 4, 1408),
        "qwen3_moe": (128, 8, 768),
        "olmoe": (64, 8, cfg.intermediate_size),
    }
    if cfg.family not in defaults:
        raise UnsupportedModelError(f"{cfg.architecture} is not a mixture-of-experts family llmctl knows")
    num_experts, top_k, intermediate = defaults[cfg.family]
    router = RouterSpec(
        int(raw.get("num_experts", raw.get("num_local_experts", num_experts))),  # Qwen3MoeConfig saves the latter
        int(raw.get("num_experts_per_tok", top_k)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )
    if cfg.family == "olmoe":
        return MoeLayout(router, cfg.intermediate_size)
    return MoeLayout(
        router,
        int(raw.get("moe_intermediate_size", intermediate)),
        int(raw.get("shared_expert_intermediate_size", 5632)) if cfg.family == "qwen2_moe" else 0,
        int(raw.get("decoder_sparse_step", 1)),
        frozenset(int(i) for i in raw.get("mlp_only_layers") or ()),
    )


def refuse_packed_experts_under_tp(cfg: ModelConfig, linear_method: LinearMethod | None, tp: TensorParallel) -> None:
    """``--quantization`` packs the experts, which run at tensor parallel size 1 only: refused
    before any weight is read."""
    if linear_method is not None and tp.size != 1:
        raise UnsupportedModelError(
            f"{cfg.architecture}: --quantization quantizes the experts into packed experts, which run "
            f"with tensor parallel size 1 only (this is {tp.size}); use --quantization none"
        )


def refuse_calibrated_experts(model: nn.Module) -> None:
    """Called before the experts are quantized: refuses a load whose linear layers were quantized
    already, i.e. by GPTQ (``--calibration``), which rounds linear layers only; experts rounded on
    their own beside them would pass for calibrated ones."""
    experts = [  # experts still to be quantized (an MXFP4 checkpoint's come packed already)
        m for m in model.modules() if isinstance(m, StackedExperts) and m.quant_method is not None and m.packed is None
    ]
    if experts and any(isinstance(m, LinearBase) and isinstance(m.method, PackedLinearMethod) for m in model.modules()):
        raise ConfigError(
            f"{model.config.architecture}: --calibration (GPTQ) does not reach a mixture-of-experts model's "
            "experts; quantize it without --calibration"
        )


class MoeAttention(LlamaAttention):
    """Llama's attention; o_proj carries a bias when ``attention_bias`` does (Qwen3-MoE)."""

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
        if cfg.attention_bias and cfg.family == "qwen3_moe":
            self.o_proj = RowParallelLinear(
                cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=True, dtype=dtype, tp=tp, method=method
            )


class OlmoeAttention(Olmo2Attention):
    """OLMo 2's attention (q/k norms over the whole projection, o_proj bias with ``attention_bias``)
    and ``clip_qkv``."""

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
        clip = cfg.raw.get("clip_qkv")
        self.clip_qkv = None if clip is None else float(clip)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.clip_qkv is None:
            return super().forward(positions, hidden, meta)
        num_tokens, clip = hidden.shape[0], self.clip_qkv
        q, k, v = self.qkv_proj(hidden).split_with_sizes(self.qkv_proj.part_sizes, -1)
        q = self._norm_whole(q, self.q_norm, 1).clamp(-clip, clip)
        k = self._norm_whole(k, self.k_norm, self.qkv_proj.kv_replicas).clamp(-clip, clip)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.clamp(-clip, clip).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's layer and forward; ``mlp`` (a ``SparseMoeBlock`` or a dense ``LlamaMLP``) is set by
    ``MoeModel``, which knows the layer's index."""

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
        attention_cls = OlmoeAttention if cfg.family == "olmoe" else MoeAttention
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.self_attn = attention_cls(cfg, dtype, tp, ops, method, rotary_emb)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.mlp: nn.Module | None = None


class MoeModel(LlamaModel):
    decoder_layer_cls = MoeDecoderLayer

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
        layout = moe_layout(cfg)
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, MoeDecoderLayer):  # another pipeline stage's
                continue
            if not layout.is_sparse(i):
                layer.mlp = LlamaMLP(cfg, dtype, tp, ops, method)
                continue
            shared = None
            if layout.shared_expert_intermediate_size:
                shared_cfg = dataclasses.replace(cfg, intermediate_size=layout.shared_expert_intermediate_size)
                shared = LlamaMLP(shared_cfg, dtype, tp, ops, method)
            layer.mlp = SparseMoeBlock(
                cfg.hidden_size,
                layout.expert_intermediate_size,
                layout.router,
                dtype=dtype,
                tp=tp,
                act=ops.silu_and_mul,
                fused_experts=ops.fused_experts,
                shared_expert=shared,
                shared_expert_gate=shared is not None,
                expert_quant_method=method if isinstance(method, OnTheFlyQuantMethod) else None,
            )


class MoeForCausalLM(LlamaForCausalLM):
    model_cls = MoeModel

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        linear_method: LinearMethod | None = None,
        tp: TensorParallel = TensorParallel(),
        **kwargs,
    ) -> None:
        refuse_packed_experts_under_tp(cfg, linear_method, tp)
        if cfg.family == "qwen2_moe":  # Qwen2MoeConfig names the q/k/v bias qkv_bias
            cfg = dataclasses.replace(cfg, attention_bias=bool(cfg.raw.get("qkv_bias", True)))
        if cfg.family == "olmoe" and "rms_norm_eps" not in cfg.raw:
            cfg = dataclasses.replace(cfg, rms_norm_eps=1e-5)  # OlmoeConfig's
        if cfg.family == "mixtral" and "rms_norm_eps" not in cfg.raw:
            cfg = dataclasses.replace(cfg, rms_norm_eps=1e-5)  # MixtralConfig's
        super().__init__(cfg, linear_method=linear_method, tp=tp, **kwargs)

    def process_weights_after_loading(self) -> None:
        refuse_calibrated_experts(self)
        super().process_weights_after_loading()


# one class per family, for the registry and for people reading a traceback
class MixtralForCausalLM(MoeForCausalLM):
    pass


class Qwen2MoeForCausalLM(MoeForCausalLM):
    pass


class Qwen3MoeForCausalLM(MoeForCausalLM):
    pass


class OlmoeForCausalLM(MoeForCausalLM):
    pass


# Whether llama.cpp renormalizes the top-k routing weights: fixed per architecture in its graph
# builders (a GGUF file of these families stores no such key); Mixtral always does.
_LLAMA_CPP_NORM_TOPK_PROB = {"Qwen2MoeForCausalLM": False, "Qwen3MoeForCausalLM": True, "OlmoeForCausalLM": False}


def moe_gguf_config(cfg: dict[str, Any], field: Callable[..., Any], tensors: dict[str, list[float]]) -> None:
    """The config of a GGUF file of these families, completed as llama.cpp reads one: top-k
    renormalization by architecture, Qwen2-MoE's q/k/v bias (``qkv_bias``) from the file's tensors;
    OLMoE's ``clip_qkv`` stays unset (llama.cpp does not clip)."""
    architecture = cfg["architectures"][0]
    if architecture in _LLAMA_CPP_NORM_TOPK_PROB:
        cfg["norm_topk_prob"] = _LLAMA_CPP_NORM_TOPK_PROB[architecture]
    cfg["qkv_bias"] = cfg["attention_bias"]


def gguf_expert_tensors(prefix: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """One layer's GGUF experts (``gate_proj.weight`` and ``up_proj.weight`` ``[E, I, H]``,
    ``down_proj.weight`` ``[E, H, I]``) as transformers stacks them: ``experts.gate_up_proj``
    ``[E, 2 I, H]`` (gate rows, then up) and ``experts.down_proj``."""
    if set(parts) != {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}:
        raise ValueError(f"expected the gate, up and down expert weights, got {sorted(parts)}")
    yield f"{prefix}.experts.gate_up_proj", torch.cat([parts["gate_proj.weight"], parts["up_proj.weight"]], dim=1)
    yield f"{prefix}.experts.down_proj", parts["down_proj.weight"]
