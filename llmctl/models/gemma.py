"""Google's Gemma, Gemma 2 and Gemma 3 (text), as transformers' modeling_gemma.py, modeling_gemma2.py
and modeling_gemma3.py compute them: one implementation, the differences read from config.json with
transformers' defaults where it leaves a value out.

Common to all three:

- RMSNorm scales by ``1 + w`` in fp32 before the cast back (``GemmaRMSNorm``, llmctl/layers/norm.py);
- the MLP is GeGLU, ``gelu(gate, approximate="tanh") * up`` (``gelu_pytorch_tanh``; Gemma 1's legacy
  ``hidden_act: "gelu"`` means the same, as transformers reads it);
- the token embeddings are multiplied by ``sqrt(hidden_size)``, rounded to fp32 and then to the
  weights' dtype as transformers rounds it (55.4256 becomes 55.5 in bf16);
- the LM head is tied to the embeddings unless config.json says otherwise; a missing ``head_dim`` is
  256.

Gemma 2 and 3 add:

- a norm after attention and after the MLP (``post_attention_layernorm``,
  ``post_feedforward_layernorm``) before each joins the residual stream, and one before the MLP
  (``pre_feedforward_layernorm``); Gemma 1 has Llama's two norms, in Llama's places;
- the attention scale ``query_pre_attn_scalar ** -0.5`` (Gemma 1: ``head_dim ** -0.5``);
- local layers attending to the last ``sliding_window`` positions only, per ``layer_types``
  (Gemma 2's default: every other layer, from the first; Gemma 3's: five of every
  ``sliding_window_pattern`` = 6);
- ``final_logit_softcapping``: logits become ``tanh(logits / cap) * cap`` (Gemma 2's default 30).

Gemma 2 also soft-caps the attention scores (``attn_logit_softcapping``, default 50) before the mask.
Gemma 3 RMS-norms q and k per head (Gemma's norm) before the rotary embedding, and rotates local
layers with their own base (``rope_local_base_freq``, default 10,000; no scaling) and global ones
with ``rope_theta`` (default 1,000,000) and ``rope_scaling``; transformers' Gemma 3 attention does
not apply ``attn_logit_softcapping``, so neither does this.

Gemma 3's multimodal checkpoints (``Gemma3ForConditionalGeneration``) run as their text model: the
registry entry reads ``text_config`` and maps the text model's tensor names (the vision tower is
not read). Not run: ``use_bidirectional_attention`` (EmbeddingGemma) and an activation other than
GeLU-tanh."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmctl.distributed import PipelineStage, TensorParallel
from llmctl.errors import ModelLoadError, UnsupportedModelError
from llmctl.layers.attention import Attention
from llmctl.layers.linear import LinearMethod, QKVParallelLinear, RowParallelLinear
from llmctl.layers.norm import GemmaRMSNorm
from llmctl.layers.ops import AttentionMetadata, TorchOps
from llmctl.layers.rotary import RotaryEmbedding
from llmctl.models.config import ModelConfig
from llmctl.models.granite import ScaledEmbedding
from llmctl.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

SLIDING, FULL = "sliding_attention", "full_attention"
_DEFAULT_HEAD_DIM = 256  # GemmaConfig, Gemma2Config, Gemma3TextConfig
_DEFAULT_MAX_POSITIONS = {"gemma": 8192, "gemma2": 8192, "gemma3_text": 131_072}
_DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
_DEFAULT_SLIDING_WINDOW = 4096
_GEMMA3_THETA = {"global": 1_000_000.0, "local": 10_000.0}  # Gemma3TextConfig.default_theta
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GELU_TANH = "gelu_pytorch_tanh"


@dataclass(frozen=True)
class GemmaSettings:
    """What the forward pass takes from config.json beyond ``ModelConfig``, with transformers' defaults."""

    layer_types: tuple[str, ...]  # SLIDING or FULL per layer
    sliding_window: int | None
    attention_scale: float
    attn_logit_softcap: float | None
    final_logit_softcap: float | None
    sandwich_norms: bool  # Gemma 2/3: pre/post-feedforward norms, the attention output normed
    qk_norm: bool  # Gemma 3
    local_rope_theta: float  # the sliding layers' rotary base (Gemma 1/2: the global one)
    local_rope_scaling: dict[str, Any] | None


def _layer_types(cfg: ModelConfig, default_every: int) -> tuple[str, ...]:
    """``layer_types`` from config.json, else every ``default_every``-th layer global, the rest local
    (as transformers' configs derive it); ``default_every`` 1: all global."""
    types = cfg.raw.get("layer_types")
    if types is None:
        return tuple(SLIDING if (i + 1) % default_every else FULL for i in range(cfg.num_layers))
    if len(types) != cfg.num_layers or not set(types) <= {SLIDING, FULL}:
        raise ModelLoadError(
            f"layer_types must name {SLIDING!r} or {FULL!r} for each of the {cfg.num_layers} layers: {types!r}"
        )
    return tuple(types)


def _rope_parts(params: dict[str, Any] | None, theta: float) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling or None) of one transformers rope dict."""
    params = dict(params or {})
    theta = float(params.pop("rope_theta", None) or theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    return theta, (None if rope_type == "default" else {**params, "rope_type": rope_type})


def gemma3_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float, dict[str, Any] | None]:
    """(global base, global scaling, local base, local scaling) as Gemma3TextConfig reads them:
    transformers 5's ``rope_parameters`` per layer type, or transformers 4's ``rope_theta`` +
    ``rope_scaling`` (global) and ``rope_local_base_freq`` (local)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full, local = params.get(FULL), params.get(SLIDING)
    else:
        full, local = raw.get("rope_scaling"), None
    global_theta, global_scaling = _rope_parts(full, raw.get("rope_theta") or _GEMMA3_THETA["global"])
    local_theta, local_scaling = _rope_parts(local, raw.get("rope_local_base_freq") or _GEMMA3_THETA["local"])
    return global_theta, global_scaling, local_theta, local_scaling


def gemma_settings(cfg: ModelConfig) -> GemmaSettings:
    raw, family = cfg.raw, cfg.family
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{cfg.architecture} with use_bidirectional_attention is not supported")
    if family == "gemma":
        activation = raw.get("hidden_act") or _GELU_TANH
        activation = _GELU_TANH if activation == "gelu" else activation  # GemmaConfig's legacy reading
    else:
        activation = raw.get("hidden_activation") or _GELU_TANH
    if activation != _GELU_TANH:
        raise UnsupportedModelError(f"{cfg.architecture} with activation {activation!r} (llmctl runs {_GELU_TANH})")
    if family == "gemma":
        return GemmaSettings(
            layer_types=_layer_types(cfg, 1),
            sliding_window=None,
            attention_scale=cfg.head_dim**-0.5,
            attn_logit_softcap=None,
            final_logit_softcap=None,
            sandwich_norms=False,
            qk_norm=False,
            local_rope_theta=cfg.rope_theta,
            local_rope_scaling=cfg.rope_scaling,
        )
    gemma2 = family == "gemma2"
    if gemma2:
        local_theta, local_scaling = cfg.rope_theta, cfg.rope_scaling
    else:
        _, _, local_theta, local_scaling = gemma3_rope(raw)
    window = raw.get("sliding_window", _DEFAULT_SLIDING_WINDOW)
    return GemmaSettings(
        layer_types=_layer_types(
            cfg, 2 if gemma2 else int(raw.get("sliding_window_pattern", _GEMMA3_SLIDING_WINDOW_PATTERN))
        ),
        sliding_window=None if window is None else int(window),
        attention_scale=raw.get("query_pre_attn_scalar", _DEFAULT_QUERY_PRE_ATTN_SCALAR) ** -0.5,
        attn_logit_softcap=_optional_float(raw.get("attn_logit_softcapping", 50.0)) if gemma2 else None,
        final_logit_softcap=_optional_float(raw.get("final_logit_softcapping", 30.0 if gemma2 else None)),
        sandwich_norms=True,
        qk_norm=not gemma2,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def with_gemma_defaults(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with transformers' Gemma defaults for what config.json leaves out (config parsing
    has the Llama ones), Gemma 3's global rotary base and scaling, and the window and layer types
    the layers attend with (config parsing knows no Gemma default for them)."""
    raw, updates = cfg.raw, {}
    if "tie_word_embeddings" not in raw:
        updates["tie_word_embeddings"] = True
    if raw.get("head_dim") is None:
        updates["head_dim"] = _DEFAULT_HEAD_DIM
    if "max_position_embeddings" not in raw:
        updates["max_position_embeddings"] = _DEFAULT_MAX_POSITIONS[cfg.family]
    if cfg.family == "gemma3_text":
        updates["rope_theta"], updates["rope_scaling"], _, _ = gemma3_rope(raw)
    cfg = dataclasses.replace(cfg, **updates)
    settings = gemma_settings(cfg)
    return dataclasses.replace(cfg, sliding_window=settings.sliding_window, layer_types=list(settings.layer_types))


# llama.cpp's Gemma 2 and 3 (a GGUF file has no query_pre_attn_scalar): the 27B models, known by their
# layer count, scale attention by hidden_size / heads, all others by head_dim (gemma_pytorch's configs)
_GGUF_27B_LAYERS = {"Gemma2ForCausalLM": 46, "Gemma3ForCausalLM": 62}


def gemma_gguf_config(cfg: dict[str, Any], field: Any, tensors: dict[str, list[float]]) -> None:
    """Gemma 2 and 3 from a GGUF file as llama.cpp reads them: ``query_pre_attn_scalar`` by its rule
    above; a Gemma 2 file without ``sliding_window`` keeps the default window (Gemma 3: none)."""
    arch = cfg["architectures"][0]
    big = cfg["num_hidden_layers"] == _GGUF_27B_LAYERS[arch]
    cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]
    if arch == "Gemma2ForCausalLM" and cfg.get("sliding_window") is None:
        cfg.pop("sliding_window", None)


class GemmaAttention(LlamaAttention):
    """Llama's attention (and its forward) with Gemma's scale, window, soft-cap and q/k norms."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: TensorParallel,
        ops: TorchOps,
        method: LinearMethod | None,
        rotary_emb: RotaryEmbedding,
        settings: GemmaSettings,
        layer_type: str,
    ) -> None:
        nn.Module.__init__(self)  # LlamaAttention's parts, with Gemma's norms and attention settings
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
        # transformers gives o_proj the q/k/v projections' bias setting
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias, dtype=dtype, tp=tp, method=method
        )
        self.rotary_emb = rotary_emb
        self.qk_norm = settings.qk_norm
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, ops=ops)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            cfg.head_dim,
            settings.attention_scale,
            ops=ops,
            sliding_window=settings.sliding_window if layer_type == SLIDING else None,
            logit_softcap=settings.attn_logit_softcap,
        )


class GemmaMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Carries the residual stream as ``(hidden, residual)`` like the Llama layers (the stream is
    their sum; ``residual`` is None before the first layer), so the final norm and pipeline stages
    work unchanged."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: TensorParallel,
        ops: TorchOps,
        method: LinearMethod | None,
        rotary_emb: RotaryEmbedding,
        settings: GemmaSettings,
        layer_type: str,
    ) -> None:
        nn.Module.__init__(self)
        self.layer_type = layer_type
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.self_attn = GemmaAttention(cfg, dtype, tp, ops, method, rotary_emb, settings, layer_type)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.mlp = GemmaMLP(cfg, dtype, tp, ops, method)
        self.sandwich_norms = settings.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)
            self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.sandwich_norms:  # Gemma 1: Llama's arrangement
            return super().forward(positions, hidden, residual, meta)
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, meta))[0]
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)  # the stream plus the attention
        return self.post_feedforward_layernorm(self.mlp(hidden))[0], residual


class GemmaModel(LlamaModel):
    decoder_layer_cls = GemmaDecoderLayer
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
        nn.Module.__init__(self)  # LlamaModel's parts; each layer gets its type's rotary table
        settings = gemma_settings(cfg)
        self.stage = stage or PipelineStage.whole(cfg.num_layers)
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, tp=tp)
        # transformers keeps sqrt(hidden_size) as an fp32 tensor and casts it to the weights' dtype
        self.embed_tokens.multiplier = float(torch.tensor(cfg.hidden_size**0.5).to(dtype))
        rotary = {
            FULL: RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, ops=ops)
        }
        local = (settings.local_rope_theta, settings.local_rope_scaling)
        rotary[SLIDING] = (
            rotary[FULL]
            if local == (cfg.rope_theta, cfg.rope_scaling)
            else RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, *local, ops=ops)
        )
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, dtype, tp, ops, method, rotary[layer_type], settings, layer_type)
            if self.stage.owns_layer(i)
            else nn.Identity()
            for i, layer_type in enumerate(settings.layer_types)
        )
        self.stage_layers = list(self.layers)[self.stage.start : self.stage.end]
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma (``GemmaForCausalLM``), Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text
    (``Gemma3ForCausalLM``): ``cfg.family`` (config.json's ``model_type``) says which."""

    model_cls = GemmaModel

    def __init__(self, cfg: ModelConfig, **kwargs: Any) -> None:
        cfg = with_gemma_defaults(cfg)
        super().__init__(cfg, **kwargs)
        self.final_logit_softcap = gemma_settings(cfg).final_logit_softcap

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcap
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap  # transformers' order: divide, tanh, multiply
