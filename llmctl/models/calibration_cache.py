"""The packed weights a ``--calibration`` load computed, kept so that the next start with the same
model files, quantization and text skips GPTQ (seconds for SmolLM2, minutes for a 7B model).

One safetensors file per combination under ``LLMCTL_GPTQ_CACHE`` (default
``$XDG_CACHE_HOME/llmctl/gptq``; ``0`` turns the cache off), named by a hash of: the cache format,
the quantization (kind, group size, dtype), the calibration token ids, and each model file's path,
size and modification time. A file that does not match the model (names, shapes, dtypes) or cannot
be read is ignored and recomputed; writes go through a temporary file and a rename, so a reader
never sees half a file.

The folder holds at most ``LLMCTL_GPTQ_CACHE_SIZE`` (default 8GiB; ``2GiB``, ``500MB``, bytes):
after each write the least recently used entries go (a hit counts as a use), never the one just
written. An entry whose model files changed is never hit again, so it ages out the same way, as do
a killed writer's temporary files.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from llmctl.layers.linear import LinearBase
from llmctl.layers.quantization import (
    OnTheFlyQuantMethod,
    PackedFp8,
    PackedInt4,
    PackedInt8,
    PackedWeight,
    install_packed_weight,
    validate_packed,
)
from llmctl.models.calibration_store import KEY_CHARS, cache_dir

CACHE_VERSION = 1  # bump when GPTQ's rounding changes, so that older entries miss


def calibrated_layers(model) -> dict[str, LinearBase]:
    """The linear layers ``--calibration`` quantizes, by module name (taken before they are: a
    quantized layer's method is the packed one)."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, LinearBase) and isinstance(m.method, OnTheFlyQuantMethod)
    }


def cache_file(
    layers: dict[str, LinearBase], dtype: torch.dtype, model_files: list[Path], token_ids: list[int]
) -> Path | None:
    """Where this load's packed weights are kept, or None (cache off, no model files, nothing to quantize)."""
    folder = cache_dir()
    if folder is None or not model_files or not layers:
        return None
    method = next(iter(layers.values())).method
    key = hashlib.sha256(f"v{CACHE_VERSION} {method.kind} g{method.group_size} {dtype}".encode())
    key.update(",".join(map(str, token_ids)).encode())
    for path in sorted(Path(p).resolve() for p in model_files):
        stat = path.stat()
        key.update(f"\n{path} {stat.st_size} {stat.st_mtime_ns}".encode())
    return folder / f"{key.hexdigest()[:KEY_CHARS]}.safetensors"


def load_cached(layers: dict[str, LinearBase], path: Path) -> bool:
    """Installs every calibrated layer's packed weight from ``path``; False (nothing changed) when
    the file is absent, unreadable or does not fit these layers."""
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            packed = {name: _packed_from(f, name, layer, names) for name, layer in layers.items()}
    except (OSError, SafetensorError, KeyError, ValueError, RuntimeError):
        return False
    if any(p is None for p in packed.values()):
        return False
    for name, layer in layers.items():
        install_packed_weight(layer, packed[name])
    try:
        os.utime(path)  # a use: least recently used entries are the first to go (prune)
    except OSError:
        pass
    return True


def _packed_from(f, name: str, layer: LinearBase, names: set[str]):
    """The packed weight stored for ``layer`` if it has the format, shapes and dtypes this layer's
    own quantization would give; else None."""
    method = layer.method
    tensors = {
        field: f.get_tensor(f"{name}.{field}") for field in ("qweight", "scales", "mins") if f"{name}.{field}" in names
    }
    if "qweight" not in tensors or "scales" not in tensors:
        return None
    qweight, scales = tensors["qweight"], tensors["scales"]
    n, k = layer.out_features, layer.in_features
    if method.kind == "int4" and "mins" in tensors and qweight.dtype == torch.uint8:
        candidate = PackedInt4(qweight, scales, tensors["mins"], method.group_size)
    elif method.kind == "int8" and qweight.dtype == torch.int8:
        candidate = PackedInt8(qweight, scales, None, qweight.shape[1])
    elif method.kind == "fp8" and qweight.dtype == torch.uint8:
        candidate = PackedFp8(qweight, scales)
    else:
        return None
    rows, cols = candidate.shape
    try:
        validate_packed(candidate)
    except ValueError:
        return None
    return candidate if rows == n and k <= cols < k + 128 else None


def save_cached(packed_by_name: dict[str, PackedWeight], path: Path) -> str | None:
    """Writes the calibrated layers' packed weights to ``path``; the reason it could not, or None."""
    tensors = {}
    for name, packed in packed_by_name.items():
        tensors[f"{name}.qweight"], tensors[f"{name}.scales"] = packed.qweight, packed.scales
        if getattr(packed, "mins", None) is not None:
            tensors[f"{name}.mins"] = packed.mins
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        return str(exc)
    return None
