"""Reading a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
into per-module weights placed on llmctl's modules, refusing clearly what llmctl cannot serve.

A PEFT target such as ``model.layers.0.self_attn.q_proj`` lands on the fused module that holds it
(``qkv_proj``, the q rows; ``gate_proj`` -> ``gate_up_proj``, part 0) through the model's
``packed_modules``, the same table the checkpoint loader uses; ``o_proj``/``down_proj`` (and a
fused target such as Phi-3's ``qkv_proj``) land whole on the module of that name.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from llmctl.config import EngineConfig
from llmctl.errors import InvalidRequestError
from llmctl.layers.linear import LinearBase, QKVParallelLinear

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$")
EMBEDDING_MODULES = frozenset({"embed_tokens", "lm_head", "wte", "word_embeddings"})
_adapter_ids = itertools.count(1)  # never reused: a reloaded name is a new adapter (prefix-cache keys)


class LoRAAdapterError(InvalidRequestError):
    """An adapter that cannot be served here: unreadable, corrupt, or asking for what is not supported."""


@dataclass(frozen=True)
class LoRAPart:
    """One target's weights on one llmctl module: output rows ``[offset, offset + size)``."""

    offset: int
    size: int
    a: torch.Tensor  # [rank, in] (lora_A.weight)
    b: torch.Tensor  # [size, rank] (lora_B.weight)
    scale: float  # its target's lora_alpha / r (rsLoRA: / sqrt(r)), rank_pattern/alpha_pattern applied


@dataclass(eq=False)
class LoRAAdapter:
    """A loaded adapter, held on the host; the slot manager copies it to a device slot on demand."""

    name: str
    path: str
    rank: int  # the largest of its targets' ranks
    modules: dict[str, list[LoRAPart]]  # llmctl module name -> its parts
    id: int = field(default_factory=lambda: next(_adapter_ids))


def _config(path: Path, label: str) -> dict:
    config_file = path / CONFIG_FILE
    if not path.is_dir():
        raise LoRAAdapterError(f"{label}: no such directory")
    if not config_file.is_file() or not (path / WEIGHTS_FILE).is_file():
        raise LoRAAdapterError(f"{label}: a PEFT adapter needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{label}: cannot read {CONFIG_FILE} ({e})") from e
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{label}: {CONFIG_FILE} is not a JSON object")
    return config


def _check_supported(config: dict, label: str, max_rank: int) -> None:
    def refuse(why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"{label}: {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LoRA")
    if config.get("use_dora"):
        raise refuse("DoRA adapters (use_dora) are not supported")
    if config.get("modules_to_save"):
        raise refuse(f"modules_to_save {config['modules_to_save']} (full module copies) are not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise refuse("LoRA bias terms are not supported (bias must be 'none')")
    if config.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out (Conv1D-style weights) is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise refuse(f"{key} must be an object of module pattern -> value, got {config[key]!r}")
        for pattern in config.get(key) or {}:
            try:
                re.compile(pattern)
            except re.error as e:
                raise refuse(f"{key} pattern {pattern!r} is not a regular expression ({e})") from e
    ranks = {"r": config.get("r")} | {f"rank_pattern[{k!r}]": v for k, v in (config.get("rank_pattern") or {}).items()}
    for where, rank in ranks.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise refuse(f"{where} must be a positive integer, got {rank!r}")
        if rank > max_rank:
            raise refuse(f"rank {rank} exceeds --max-lora-rank {max_rank}")
    alphas = {"lora_alpha": config.get("lora_alpha", config["r"])} | {
        f"alpha_pattern[{k!r}]": v for k, v in (config.get("alpha_pattern") or {}).items()
    }
    for where, alpha in alphas.items():
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
            raise refuse(f"{where} must be a positive number, got {alpha!r}")


def _pattern_value(patterns: dict, target: str, default: int | float) -> int | float:
    """PEFT's per-module override (``peft.utils.other.get_pattern_key``): the first pattern that
    matches the end of the target's name at a dot boundary, else the adapter-wide value."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", target):
            return value
    return default


def _target_scale(config: dict, target: str) -> tuple[int, float]:
    """(rank, scale) of one target module: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    rank = _pattern_value(config.get("rank_pattern") or {}, target, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern") or {}, target, config.get("lora_alpha", config["r"]))
    return rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def config_with_adapters(config: EngineConfig, lora_modules: tuple[str, ...]) -> EngineConfig:
    """``config`` serving the ``NAME=DIR`` adapters (``chat --lora``, ``bench --lora-modules``): a
    slot each, as wide as the largest rank their configs declare."""
    ranks = [_declared_rank(entry.partition("=")[2]) or 0 for entry in lora_modules]
    return dataclasses.replace(
        config,
        lora_modules=tuple(lora_modules),
        max_loras=len(lora_modules),
        max_lora_rank=max(config.max_lora_rank, *ranks),
    )


def _declared_rank(path: str | Path) -> int | None:
    """The largest rank an adapter directory's config declares (``r``, ``rank_pattern``), to size
    the slots for it; None when it cannot be read (loading it then says why)."""
    try:
        config = json.loads((Path(path) / CONFIG_FILE).read_text())
        ranks = [config["r"], *(config.get("rank_pattern") or {}).values()]
        return max(r for r in ranks if isinstance(r, int) and not isinstance(r, bool))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _placement(model: nn.Module, modules: dict[str, nn.Module], target: str, label: str) -> tuple[str, int, int]:
    """(llmctl module name, output offset, rows) of a PEFT target module name."""
    prefix, _, leaf = target.rpartition(".")
    packed = getattr(model, "packed_modules", {})
    if leaf in packed and f"{prefix}.{packed[leaf][0]}" in modules:
        merged, part = packed[leaf]
        name = f"{prefix}.{merged}"
        module = modules[name]
        index = {"q": 0, "k": 1, "v": 2}[part] if isinstance(module, QKVParallelLinear) else int(part)
        offset, size = module.part_offset(index)
        return name, offset, size
    module = modules.get(target)
    if not isinstance(module, LinearBase):
        raise LoRAAdapterError(f"{label}: the model has no linear module {target!r} to adapt")
    return target, 0, module.out_features


def load_adapter(name: str, path: str | Path, model: nn.Module, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check a PEFT adapter for ``model``; raises ``LoRAAdapterError`` naming the adapter
    (its name and directory: a server with many models and adapters says which) and what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    label = f"LoRA adapter {name} ({path})"
    config = _config(path, label)
    _check_supported(config, label, max_rank)
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoRAAdapterError(f"{label}: cannot read {WEIGHTS_FILE} ({e})") from e
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_magnitude_vector" in key:
            raise LoRAAdapterError(f"{label}: DoRA adapters are not supported ({key})")
        if "lora_embedding" in key or EMBEDDING_MODULES.intersection(key.split(".")):
            raise LoRAAdapterError(f"{label}: embedding and lm_head targets are not supported ({key})")
        match = _KEY.match(key)
        if match is None:
            raise LoRAAdapterError(f"{label}: unexpected tensor {key!r} (only lora_A/lora_B weights)")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise LoRAAdapterError(f"{label}: {WEIGHTS_FILE} holds no LoRA weights")
    modules = dict(model.named_modules())
    placed: dict[str, list[LoRAPart]] = {}
    for target, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"{label}: {target} lacks lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"], pair["B"]
        module_name, offset, size = _placement(model, modules, target, label)
        in_features = modules[module_name].in_features
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] > max_rank:
            raise LoRAAdapterError(
                f"{label}: {target} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                f"(need [r, in] and [out, r] with r <= --max-lora-rank {max_rank})"
            )
        rank, scale = _target_scale(config, target)
        if a.shape[0] != rank:
            raise LoRAAdapterError(
                f"{label}: {target} has rank {a.shape[0]} but {CONFIG_FILE} gives it rank {rank} (r, rank_pattern)"
            )
        if a.shape[1] != in_features or b.shape[0] != size:
            raise LoRAAdapterError(
                f"{label}: {target} maps {a.shape[1]} -> {b.shape[0]} features but the model's "
                f"module takes {in_features} -> {size}: an adapter of another base model?"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAAdapterError(f"{label}: {target} holds NaN or infinite weights")
        placed.setdefault(module_name, []).append(LoRAPart(offset, size, a.to(dtype), b.to(dtype), float(scale)))
    rank = max(part.a.shape[0] for parts in placed.values() for part in parts)
    return LoRAAdapter(name, str(path), rank, placed)
