"""The subset of a Hugging Face ``config.json`` the engine needs, normalised across
transformers versions (``rope_scaling``/``rope_theta`` in v4, ``rope_parameters`` in v5)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmctl.errors import ConfigError, ModelLoadError, UnsupportedModelError
from llmctl.models import registry

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # one line for people: why this dtype, on this machine

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def choose_dtype(
    requested: str, checkpoint_dtype: str | None, device: torch.device, cpu_flags: frozenset[str] | None = None
) -> DtypeChoice:
    """``auto`` runs a checkpoint in its own dtype (float32 when unstated), except on a CPU, where
    half precision is only worth it with bf16 arithmetic units (AMX, AVX512-BF16): without them
    every bf16 op converts to fp32 and back, which measured ~3x slower than fp32 on an AVX2 EPYC
    (docs/benchmarks.md). So a bf16/fp16 checkpoint runs in bf16 on such CPUs, in fp32 elsewhere;
    fp16 itself is never chosen on a CPU (no CPU computes it natively, and its range is narrow)."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ConfigError(f"unknown dtype {requested!r}; choose auto, {', '.join(DTYPES)}")
        return DtypeChoice(DTYPES[requested], "requested with --dtype")
    stored = DTYPES.get(str(checkpoint_dtype).replace("torch.", ""))
    if stored is None or stored == torch.float32:
        return DtypeChoice(
            torch.float32, "auto: the checkpoint's dtype" if stored else "auto: the checkpoint states no dtype"
        )
    if device.type != "cpu":
        return DtypeChoice(stored, "auto: the checkpoint's dtype")
    from llmctl_kernels.cpu_features import native_bf16_units

    units = native_bf16_units(cpu_flags)
    if units:
        return DtypeChoice(torch.bfloat16, f"auto: this CPU computes bf16 natively ({', '.join(units)})")
    return DtypeChoice(
        torch.float32,
        f"auto: {checkpoint_dtype} checkpoint, but this CPU has no native bf16 "
        "(AVX512-BF16 or AMX), where fp32 is faster",
    )


@dataclass
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    mlp_bias: bool
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    # Per layer, as transformers names them: "sliding_attention" (attends within ``sliding_window``)
    # or "full_attention". Empty: every layer sliding when ``sliding_window`` is set, else full.
    layer_types: list[str] = field(default_factory=list)
    # (rope base, rope scaling or None) of a layer type whose rotary differs from the model's
    # ``rope_theta`` / ``rope_scaling`` (transformers 5 writes ``rope_parameters`` per layer type:
    # OLMo 3 scales the full-attention layers' rope only)
    layer_rope: dict[str, tuple[float, dict[str, Any] | None]] = field(default_factory=dict)
    # checkpoint-name prefix -> the text model's, None: not read (a multimodal checkpoint's other towers)
    checkpoint_prefixes: tuple[tuple[str, str | None], ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    dtype_choice: DtypeChoice | None = field(default=None, repr=False)  # set by resolve_dtype

    def __post_init__(self) -> None:
        if not self.layer_types:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            self.layer_types = [kind] * self.num_layers

    def rope_for(self, layer_type: str) -> tuple[float, dict[str, Any] | None]:
        """The rotary base and scaling of the layers of ``layer_type``."""
        return self.layer_rope.get(layer_type, (self.rope_theta, self.rope_scaling))

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer`` in tokens (None: it attends to the whole
        context), as transformers gives each layer ``config.sliding_window if its layer_type is
        "sliding_attention" else None``."""
        if self.sliding_window and self.layer_types[layer] == "sliding_attention":
            return int(self.sliding_window)
        return None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        spec = next(filter(None, map(registry.family_for, archs)), None)
        if spec is None and not archs:
            spec = registry.family_for_model_type(cfg.get("model_type", ""))
        if spec is None:
            named = ", ".join(archs) or repr(cfg.get("model_type"))
            raise UnsupportedModelError(
                f"{source}: architecture {named} is not supported; llmctl runs " + ", ".join(registry.architectures())
            )
        if spec.text_architecture is not None:
            return cls._text_model_of(spec, cfg, source)
        arch, family = spec.architecture, spec.model_type
        # a bare decoder (an embedding model's checkpoint) has no LM head: the embeddings stand in
        base_model = any(registry.is_base_model(name) for name in archs) and registry.family_for(archs[0]) is spec
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            rope = cfg.get("rope_parameters") or {}
            per_type = {kind: rope[kind] for kind in _LAYER_TYPES if isinstance(rope.get(kind), dict)}
            if per_type:  # transformers 5, per layer type: the model's own rope is the full layers'
                rope = per_type.get("full_attention") or next(iter(per_type.values()))
            rope_scaling = _rope_scaling(cfg.get("rope_scaling") or rope)
            rope_theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
            eos = cfg.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
            use_sliding = cfg.get("use_sliding_window", spec.sliding_window_by_default)
            sliding_window = cfg.get("sliding_window") if use_sliding else None
            num_layers = int(cfg["num_hidden_layers"])
            layer_types = _layer_types(cfg, num_layers, sliding_window, family)
            return cls(
                architecture=arch,
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=base_model or bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", spec.attention_bias)),
                qk_norm=spec.qk_norm,
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                sliding_window=sliding_window,
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                layer_types=layer_types,
                layer_rope={
                    kind: (float(params.get("rope_theta", rope_theta)), _rope_scaling(params))
                    for kind, params in per_type.items()
                    if params is not rope
                },
                raw=cfg,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: missing or malformed field {exc}") from exc

    @classmethod
    def _text_model_of(cls, spec: registry.ModelFamily, cfg: dict[str, Any], source: str) -> ModelConfig:
        """A multimodal checkpoint as its text model: ``text_config`` (with the outer config's dtype
        and special tokens where it has none) and the family's checkpoint-name prefixes."""
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ModelLoadError(f"{source}: {spec.architecture} without a text_config")
        inherited = {key: cfg[key] for key in _INHERITED_BY_TEXT_CONFIG if key in cfg and key not in text}
        config = cls.from_dict({**inherited, **text, "architectures": [spec.text_architecture]}, source)
        return dataclasses.replace(config, checkpoint_prefixes=spec.checkpoint_prefixes)

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as the model's (None: a tensor llmctl does not read)."""
        for prefix, replacement in self.checkpoint_prefixes:
            if name.startswith(prefix):
                return None if replacement is None else replacement + name[len(prefix) :]
        return name

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: not found (a model directory needs config.json)")
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(cfg, source=str(path))

    def resolve_dtype(self, requested: str, device: torch.device) -> torch.dtype:
        """The dtype to run in (see ``choose_dtype``); the choice and its reason stay on
        ``self.dtype_choice`` for the startup line."""
        self.dtype_choice = choose_dtype(requested, self.torch_dtype, device)
        return self.dtype_choice.dtype


_LAYER_TYPES = ("full_attention", "sliding_attention")
# what a multimodal config.json says at its top level for the text model too
_INHERITED_BY_TEXT_CONFIG = ("torch_dtype", "dtype", "bos_token_id", "eos_token_id", "tie_word_embeddings")


def _rope_scaling(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """A transformers rope dict as llmctl's scaling (``rope_type`` always set), None for the
    default rope."""
    if not params:
        return None
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return None if rope_type == "default" else {**scaling, "rope_type": rope_type}


# transformers' Qwen2Config / Qwen3Config default for ``max_window_layers`` when config.json omits it
_MAX_WINDOW_LAYERS_DEFAULT = {"qwen2": 28, "qwen3": 28}


def _layer_types(cfg: dict[str, Any], num_layers: int, sliding_window: Any, family: str) -> list[str]:
    """config.json's ``layer_types`` when it has them, else as transformers derives them (Qwen2's
    and Qwen3's configuration: layer ``i`` slides when there is a window and ``i >=
    max_window_layers``; Mistral: every layer, when there is a window)."""
    explicit = cfg.get("layer_types")
    if explicit is not None:
        types = [str(t) for t in explicit]
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        return types
    first_sliding = int(cfg.get("max_window_layers", _MAX_WINDOW_LAYERS_DEFAULT.get(family, 0)))
    return [
        "sliding_attention" if sliding_window is not None and i >= first_sliding else "full_attention"
        for i in range(num_layers)
    ]
