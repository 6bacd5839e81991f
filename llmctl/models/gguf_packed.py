"""GGUF weights kept quantized in memory: packed tensors go straight into the built model's
layers (``install_packed_weight`` / ``install_packed_embedding``, the quantization package's
contract), everything else (norms, biases, F32/F16/BF16 matrices) through the plain loader.

A merged projection (QKV, gate-up) gets its parts concatenated in the layer's order; parts in
different packed formats stay apart, each run of one format a packed layer of its own
(``SplitPackedMethod``), and a merge that mixes packed and float parts is dequantized as a whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from llmctl.errors import ModelLoadError
from llmctl.models import gguf_quants
from llmctl.models.registry import CausalLM
from llmctl_kernels.packed_formats import PackedWeight

_EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")


def _part_key(part: str | int) -> int:
    return {"q": 0, "k": 1, "v": 2}.get(part, part) if isinstance(part, str) else part


def install_packed(
    model: CausalLM, tensors: Iterator[tuple[str, PackedWeight | torch.Tensor]], path: Path
) -> list[tuple[Path, str, torch.Tensor]]:
    """Installs every packed GGUF tensor; returns the rest, as float, for ``load_weights``."""
    from llmctl.layers.quantization import install_packed_embedding, install_packed_weight
    from llmctl.layers.quantization.methods import install_split_packed_weight

    dense: list[tuple[Path, str, torch.Tensor]] = []
    merged: dict[str, dict[str | int, tuple[str, PackedWeight | torch.Tensor]]] = {}
    for name, value in tensors:
        is_part = name.endswith(".weight") and any(f".{c}." in name for c in model.packed_modules)
        if isinstance(value, torch.Tensor) and not is_part:  # a float part waits for its siblings
            dense.append((path, name, value))
            continue
        if name in _EMBEDDINGS:
            _install(install_packed_embedding, model.get_submodule(name.rsplit(".", 1)[0]), value, path, name)
            if name == _EMBEDDINGS[0] and model.config.tie_word_embeddings:
                _install(install_packed_embedding, model.lm_head, value, path, name)
            continue
        module, part = name.rsplit(".", 1)[0], None
        for ckpt_name, (merged_name, merged_part) in model.packed_modules.items():
            if module.endswith(f".{ckpt_name}"):
                module, part = module[: -len(ckpt_name)] + merged_name, merged_part
                break
        merged.setdefault(module, {})[part] = (name, value)
    for module, parts in merged.items():
        ordered = [parts[p] for p in sorted(parts, key=_part_key)] if None not in parts else [parts[None]]
        values = [value for _, value in ordered]
        if gguf_quants.formats_differ(values):  # runs of one format each, side by side
            runs = [gguf_quants.concat_parts(run) for run in gguf_quants.format_runs(values)]
            _install(install_split_packed_weight, model.get_submodule(module), runs, path, module)
            continue
        packed = gguf_quants.concat_parts(values)
        if packed is None:  # a float part (or only float parts): this layer runs dequantized
            dense.extend((path, name, gguf_quants.to_float(value)) for name, value in ordered)
            continue
        _install(install_packed_weight, model.get_submodule(module), packed, path, module)
    return dense


def _install(install, layer: torch.nn.Module, packed: PackedWeight, path: Path, name: str) -> None:
    try:
        install(layer, packed)
    except (ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{path}: tensor {name!r} does not fit the model: {exc}") from exc
