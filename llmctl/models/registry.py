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
    native_decode_why_not: str | None = None  # None: the native CPU decode loop can take it
    triton: bool = True  # the Triton kernels run it (they are per-op, so every family so far)

    def model_class(self) -> type[CausalLM]:
        """The implementing class, imported on first use."""
        return getattr(importlib.import_module(self.module), self.class_name)


_LLAMA_MODULE = "llmctl.models.llama"

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
        native_decode_why_not="per-head q/k norm",
    ),
    ModelFamily(
        "GraniteForCausalLM",
        "granite",
        "llmctl.models.granite",
        "GraniteForCausalLM",
        "Granite 3",
        multipliers=("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"),
        native_decode_why_not="GraniteForCausalLM's residual multiplier",
    ),
)

_BY_ARCHITECTURE = {family.architecture: family for family in FAMILIES}
_BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES}
_BY_GGUF_ARCHITECTURE = {family.gguf_architecture: family for family in FAMILIES if family.gguf_architecture}


def architectures() -> list[str]:
    """Every architecture name llmctl runs, in registry order (for messages and listings)."""
    return [family.architecture for family in FAMILIES]


def family_for(architecture: str) -> ModelFamily | None:
    return _BY_ARCHITECTURE.get(architecture)


def family_for_model_type(model_type: str) -> ModelFamily | None:
    """For a config.json that names no architecture, only its ``model_type``."""
    return _BY_MODEL_TYPE.get(model_type)


def gguf_architectures() -> list[str]:
    return list(_BY_GGUF_ARCHITECTURE)


def family_for_gguf(gguf_architecture: str) -> ModelFamily | None:
    return _BY_GGUF_ARCHITECTURE.get(gguf_architecture)


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
