"""Which model families llmctl runs, and what each needs: the one place the loader, config parsing,
the GGUF reader, the fast-path checks and ``llmctl ls`` look a family up.

A family is a ``config.json`` architecture name (``architectures[0]``) mapped to the class that
implements it, imported lazily by module path so that reading the registry costs no torch model
code. docs/models.md ("Adding a model family") says which files a new family touches.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from llmctl.layers.attention import Attention
    from llmctl.layers.ops import AttentionMetadata
    from llmctl.models.config import ModelConfig


@dataclass(frozen=True)
class ModelFamily:
    """One architecture and what its implementation needs from the shared layers."""

    architecture: str  # config.json ``architectures[0]``, e.g. "LlamaForCausalLM"
    model_type: str  # config.json ``model_type`` (transformers' name for the family)
    module: str  # the module that implements it ...
    class_name: str  # ... and the class there
    name: str  # for people: README.md's Models bullet lists these
    rope: str = "rotate-half"  # rotary variant (``rope_scaling`` from config.json picks its scaling)
    norm: str = "rmsnorm"
    activation: str = "silu-glu"
    qk_norm: bool = False  # per-head RMSNorm on q and k before the rotary embedding
    attention_bias: bool = False  # q/k/v bias when config.json does not say (``attention_bias``)
    sliding_window_by_default: bool = False  # ``use_sliding_window`` when config.json does not say
    multipliers: tuple[str, ...] = ()  # config.json scalars the forward pass applies
    gguf_architecture: str | None = None  # GGUF ``general.architecture``; None: not read from GGUF
    gguf_interleaved_qk: bool = False  # llama.cpp's converter interleaves Q/K rows per head
    # GGUF key (after "<arch>.") -> config.json field, copied where the file has the key
    gguf_metadata: tuple[tuple[str, str], ...] = ()
    # GGUF tensor (after "blk.N.") -> Hugging Face module, where llama.cpp's table is ambiguous for us
    gguf_tensors: tuple[tuple[str, str], ...] = ()
    gguf_norm_offset: float = 0.0  # what llama.cpp's converter adds to every norm weight
    gguf_config: str | None = None  # a function in ``module`` that completes the config from the file
    # a function in ``module``: one layer's stacked GGUF expert tensors -> the checkpoint's (None: no experts)
    gguf_experts: str | None = None
    native_decode_why_not: str | None = None  # None: the native CPU decode loop can take it
    # A multimodal checkpoint whose text model llmctl runs: the architecture its config.json's
    # ``text_config`` describes, and checkpoint-name prefixes -> the text model's (None: another
    # tower's tensor, not read)
    text_architecture: str | None = None
    checkpoint_prefixes: tuple[tuple[str, str | None], ...] = ()
    triton: bool = True  # the Triton kernels run it (they are per-op, so every family so far)

    def model_class(self) -> type[CausalLM]:
        """The implementing class, imported on first use."""
        return getattr(importlib.import_module(self.module), self.class_name)

    def gguf_config_hook(self) -> Any:
        """``gguf_config``'s function, imported on first use (None when the family has none)."""
        return getattr(importlib.import_module(self.module), self.gguf_config) if self.gguf_config else None

    def gguf_experts_hook(self) -> Any:
        """``gguf_experts``'s function, imported on first use (None when the family has none)."""
        return getattr(importlib.import_module(self.module), self.gguf_experts) if self.gguf_experts else None


_LLAMA_MODULE = "llmctl.models.llama"
_GEMMA_MODULE = "llmctl.models.gemma"
_MOE_MODULE = "llmctl.models.moe_families"

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        "LlamaForCausalLM",
        "llama",
        _LLAMA_MODULE,
        "LlamaForCausalLM",
        "Llama 2/3",
        gguf_architecture="llama",
        gguf_interleaved_qk=True,
    ),
    ModelFamily(
        "MistralForCausalLM",
        "mistral",
        _LLAMA_MODULE,
        "LlamaForCausalLM",
        "Mistral",
        sliding_window_by_default=True,
        gguf_architecture="mistral",
        gguf_interleaved_qk=True,
    ),
    ModelFamily(
        "Qwen2ForCausalLM",
        "qwen2",
        _LLAMA_MODULE,
        "LlamaForCausalLM",
        "Qwen2",
        attention_bias=True,
        gguf_architecture="qwen2",
    ),
    ModelFamily(
        "Qwen3ForCausalLM",
        "qwen3",
        _LLAMA_MODULE,
        "LlamaForCausalLM",
        "Qwen3",
        qk_norm=True,
        gguf_architecture="qwen3",
    ),
    ModelFamily(
        "GraniteForCausalLM",
        "granite",
        "llmctl.models.granite",
        "GraniteForCausalLM",
        "Granite 3",
        multipliers=("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"),
        gguf_architecture="granite",
        gguf_interleaved_qk=True,
        gguf_metadata=(
            ("attention.scale", "attention_multiplier"),
            ("embedding_scale", "embedding_multiplier"),
            ("residual_scale", "residual_multiplier"),
            ("logit_scale", "logits_scaling"),
        ),
        gguf_config="granite_gguf_config",
        native_decode_why_not="GraniteForCausalLM's residual multiplier",
    ),
    ModelFamily(
        "SmolLM3ForCausalLM",
        "smollm3",
        "llmctl.models.smollm3",
        "SmolLM3ForCausalLM",
        "SmolLM3",
        gguf_architecture="smollm3",  # llama.cpp fixes the layers without rotary at every 4th
        gguf_interleaved_qk=True,
        native_decode_why_not="SmolLM3ForCausalLM's layers without rotary embedding",
    ),
    ModelFamily(
        "Olmo2ForCausalLM",
        "olmo2",
        "llmctl.models.olmo2",
        "Olmo2ForCausalLM",
        "OLMo 2",
        gguf_architecture="olmo2",
        native_decode_why_not="Olmo2ForCausalLM's norms after attention and MLP",
    ),
    ModelFamily(
        "Olmo3ForCausalLM",
        "olmo3",
        "llmctl.models.olmo2",
        "Olmo2ForCausalLM",
        "OLMo 3",
        sliding_window_by_default=True,
        native_decode_why_not="Olmo3ForCausalLM's norms after attention and MLP",
    ),
    ModelFamily(
        "Phi3ForCausalLM",
        "phi3",
        "llmctl.models.phi3",
        "Phi3ForCausalLM",
        "Phi-3/3.5/4",
        sliding_window_by_default=True,
        gguf_architecture="phi3",
        gguf_metadata=(("rope.scaling.original_context_length", "original_max_position_embeddings"),),
        gguf_tensors=(("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj")),
        gguf_config="phi3_gguf_config",
        native_decode_why_not="Phi3ForCausalLM's LongRoPE table chosen per sequence",
    ),
    ModelFamily(
        "GemmaForCausalLM",
        "gemma",
        _GEMMA_MODULE,
        "GemmaForCausalLM",
        "Gemma",
        norm="rmsnorm-1+w",
        activation="gelu-tanh-glu",
        gguf_architecture="gemma",
        gguf_norm_offset=1.0,
        native_decode_why_not="GemmaForCausalLM's (1 + w) RMSNorm and GeGLU",
    ),
    ModelFamily(
        "Gemma2ForCausalLM",
        "gemma2",
        _GEMMA_MODULE,
        "GemmaForCausalLM",
        "Gemma 2",
        norm="rmsnorm-1+w",
        activation="gelu-tanh-glu",
        multipliers=("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"),
        gguf_architecture="gemma2",
        gguf_metadata=(
            ("attn_logit_softcapping", "attn_logit_softcapping"),
            ("final_logit_softcapping", "final_logit_softcapping"),
        ),
        gguf_norm_offset=1.0,
        gguf_config="gemma_gguf_config",
        native_decode_why_not="Gemma2ForCausalLM's (1 + w) RMSNorms, GeGLU and soft-capping",
    ),
    ModelFamily(
        "Gemma3ForCausalLM",
        "gemma3_text",
        _GEMMA_MODULE,
        "GemmaForCausalLM",
        "Gemma 3 (text)",
        norm="rmsnorm-1+w",
        activation="gelu-tanh-glu",
        qk_norm=True,
        multipliers=("query_pre_attn_scalar", "final_logit_softcapping"),
        gguf_architecture="gemma3",
        gguf_metadata=(
            ("final_logit_softcapping", "final_logit_softcapping"),
            ("rope.freq_base_swa", "rope_local_base_freq"),
        ),
        gguf_norm_offset=1.0,
        gguf_config="gemma_gguf_config",
        native_decode_why_not="Gemma3ForCausalLM's (1 + w) RMSNorms, GeGLU and two rotary bases",
    ),
    ModelFamily(
        "Gemma3ForConditionalGeneration",
        "gemma3",
        _GEMMA_MODULE,
        "GemmaForCausalLM",
        "Gemma 3 multimodal (its text model)",
        norm="rmsnorm-1+w",
        activation="gelu-tanh-glu",
        qk_norm=True,
        multipliers=("query_pre_attn_scalar", "final_logit_softcapping"),
        text_architecture="Gemma3ForCausalLM",
        checkpoint_prefixes=(
            ("language_model.model.", "model."),  # transformers' saved layout (Gemma 3 4B, 12B, 27B)
            ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."),
            ("vision_tower.", None),
            ("multi_modal_projector.", None),
            ("model.vision_tower.", None),
            ("model.multi_modal_projector.", None),
        ),
        native_decode_why_not="Gemma3ForCausalLM's (1 + w) RMSNorms, GeGLU and two rotary bases",
    ),
    ModelFamily(
        "MixtralForCausalLM",
        "mixtral",
        _MOE_MODULE,
        "MixtralForCausalLM",
        "Mixtral",
        sliding_window_by_default=True,
        gguf_architecture="llama",  # llama.cpp's converter writes Mixtral as Llama with experts
        gguf_interleaved_qk=True,
        gguf_config="moe_gguf_config",
        gguf_experts="gguf_expert_tensors",
    ),
    ModelFamily(
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        _MOE_MODULE,
        "Qwen2MoeForCausalLM",
        "Qwen2-MoE",
        attention_bias=True,
        gguf_architecture="qwen2moe",
        gguf_metadata=(
            ("expert_feed_forward_length", "moe_intermediate_size"),
            ("expert_shared_feed_forward_length", "shared_expert_intermediate_size"),
        ),
        gguf_config="moe_gguf_config",
        gguf_experts="gguf_expert_tensors",
    ),
    ModelFamily(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        _MOE_MODULE,
        "Qwen3MoeForCausalLM",
        "Qwen3-MoE",
        qk_norm=True,
        gguf_architecture="qwen3moe",
        gguf_metadata=(("expert_feed_forward_length", "moe_intermediate_size"),),
        gguf_config="moe_gguf_config",
        gguf_experts="gguf_expert_tensors",
    ),
    ModelFamily(
        "OlmoeForCausalLM",
        "olmoe",
        _MOE_MODULE,
        "OlmoeForCausalLM",
        "OLMoE",
        gguf_architecture="olmoe",
        gguf_config="moe_gguf_config",
        gguf_experts="gguf_expert_tensors",
        native_decode_why_not="OlmoeForCausalLM's q/k norms over the whole projection",
    ),
    ModelFamily(
        "GptOssForCausalLM",
        "gpt_oss",
        "llmctl.models.gpt_oss",
        "GptOssForCausalLM",
        "gpt-oss",
        attention_bias=True,
        sliding_window_by_default=True,
        activation="clamped-swiglu",
        gguf_architecture="gpt-oss",
        gguf_tensors=(("ffn_gate_inp", "mlp.router"),),
        gguf_experts="gpt_oss_gguf_experts",
    ),
    ModelFamily(
        "DeepseekV2ForCausalLM",
        "deepseek_v2",
        "llmctl.models.deepseek_v2",
        "DeepseekV2ForCausalLM",
        "DeepSeek-V2/V2-Lite",
        rope="interleaved",  # llama.cpp's deepseek2 rotates adjacent pairs too: no Q/K rows to restore
        gguf_architecture="deepseek2",
        gguf_metadata=(
            ("attention.kv_lora_rank", "kv_lora_rank"),
            ("expert_count", "n_routed_experts"),
            ("rope.dimension_count", "qk_rope_head_dim"),
            ("expert_feed_forward_length", "moe_intermediate_size"),
            ("expert_shared_count", "n_shared_experts"),
            ("leading_dense_block_count", "first_k_dense_replace"),
            ("expert_weights_scale", "routed_scaling_factor"),
            ("expert_group_count", "n_group"),
            ("expert_group_used_count", "topk_group"),
        ),
        gguf_tensors=(
            ("attn_q_a", "self_attn.q_a_proj"),
            ("attn_q_a_norm", "self_attn.q_a_layernorm"),
            ("attn_q_b", "self_attn.q_b_proj"),
            ("attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa"),
            ("attn_kv_a_norm", "self_attn.kv_a_layernorm"),
            ("attn_kv_b", "self_attn.kv_b_proj"),  # older files: kv_b_proj whole
            ("attn_k_b", "self_attn.k_b_proj"),  # newer: split for llama.cpp's absorbed MLA
            ("attn_v_b", "self_attn.v_b_proj"),
            ("ffn_gate_shexp", "mlp.shared_experts.gate_proj"),
            ("ffn_up_shexp", "mlp.shared_experts.up_proj"),
            ("ffn_down_shexp", "mlp.shared_experts.down_proj"),
        ),
        gguf_config="deepseek_gguf_config",
        gguf_experts="gguf_expert_tensors",
        native_decode_why_not="multi-head latent attention (its latent cache has a torch reference only)",
        triton=False,
    ),
)

_BY_ARCHITECTURE = {family.architecture: family for family in FAMILIES}
_BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES}


def architectures() -> list[str]:
    """Every architecture name llmctl runs, in registry order (for messages and listings)."""
    return [family.architecture for family in FAMILIES]


# A family's bare decoder (``Qwen3Model`` for ``Qwen3ForCausalLM``): what sentence-transformers
# saves for an embedding model, with no LM head and tensor names without the ``model.`` prefix.
_BY_BASE_MODEL = {family.architecture.removesuffix("ForCausalLM") + "Model": family for family in FAMILIES}


def family_for(architecture: str) -> ModelFamily | None:
    return _BY_ARCHITECTURE.get(architecture) or _BY_BASE_MODEL.get(architecture)


def is_base_model(architecture: str) -> bool:
    """True for a family's bare decoder (no LM head), e.g. an embedding model's checkpoint."""
    return architecture not in _BY_ARCHITECTURE and architecture in _BY_BASE_MODEL


def family_for_model_type(model_type: str) -> ModelFamily | None:
    """For a config.json that names no architecture, only its ``model_type``."""
    return _BY_MODEL_TYPE.get(model_type)


def gguf_architectures() -> list[str]:
    return list(dict.fromkeys(family.gguf_architecture for family in FAMILIES if family.gguf_architecture))


def family_for_gguf(gguf_architecture: str, experts: bool | None = None) -> ModelFamily | None:
    """The family of a GGUF file's ``general.architecture``; ``experts`` (whether the file holds
    expert tensors) tells apart the families llama.cpp writes under one name (Mixtral as ``llama``)."""
    for family in FAMILIES:
        if family.gguf_architecture == gguf_architecture and experts in (None, family.gguf_experts is not None):
            return family
    return None


class CausalLM(Protocol):
    """What the engine, the loaders and the fast paths use of a model, whichever family: an
    ``nn.Module`` whose parameters carry Hugging Face's checkpoint names, with merged projections
    (``packed_modules``) and a decoder stack at ``.model`` (``embed_tokens``, ``stage``,
    ``stage_layers``, ``norm``)."""

    config: ModelConfig
    model: Any  # the decoder stack
    lm_head: Any
    packed_modules: dict[str, tuple[str, str | int]]

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def attention_layers(self) -> list[Attention]: ...

    def owns_checkpoint_tensor(self, name: str) -> bool: ...

    def process_weights_after_loading(self) -> None: ...

    # the nn.Module methods the engine relies on
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]: ...

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def get_submodule(self, target: str) -> nn.Module: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...

    def eval(self) -> CausalLM: ...
