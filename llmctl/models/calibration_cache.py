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
import re
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from llmctl.config import parse_size
from llmctl.errors import ConfigError
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

CACHE_VERSION = 1  # bump when GPTQ's rounding changes, so that older entries miss
KEY_CHARS = 40  # hex digits of the key in an entry's name
_ENTRY_NAME = re.compile(rf"[0-9a-f]{{{KEY_CHARS}}}(?:\.safetensors|(\.[0-9]+\.tmp))")  # group 1: a writer's temp file
DEFAULT_CACHE_SIZE = "8GiB"
STALE_TMP_SECONDS = 3600  # a temporary file this old belongs to a writer that is gone


def cache_dir() -> Path | None:
    setting = os.environ.get("LLMCTL_GPTQ_CACHE")
    if setting == "0":
        return None
    return Path(setting) if setting else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmctl" / "gptq"


def cache_size_limit() -> int:
    """``LLMCTL_GPTQ_CACHE_SIZE`` in bytes (a clear error for a value it cannot read)."""
    setting = os.environ.get("LLMCTL_GPTQ_CACHE_SIZE") or DEFAULT_CACHE_SIZE
    try:
        return parse_size(setting)
    except ConfigError as exc:
        raise ConfigError(f"LLMCTL_GPTQ_CACHE_SIZE: {exc}") from None


def calibrated_layers(model) -> dict[str, LinearBase]:
    """The linear layers ``--calibration`` quantizes, by module name (taken before they are: a
    quantized layer's method is the packed one)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, LinearBase) and isinstance(m.method, OnTheFlyQuantMethod)}


def cache_file(layers: dict[str, LinearBase], dtype: torch.dtype, model_files: list[Path],
               token_ids: list[int]) -> Path | None:
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
    tensors = {field: f.get_tensor(f"{name}.{field}") for field in ("qweight", "scales", "mins")
               if f"{name}.{field}" in names}
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


def prune(folder: Path, keep: Path, limit: int) -> tuple[int, int]:
    """Deletes the least recently used entries of ``folder`` (never ``keep``) until the entries
    take at most ``limit`` bytes, and temporary files older than ``STALE_TMP_SECONDS``; returns how
    many entries it deleted and their bytes. Only files named as this module names them are
    touched (``LLMCTL_GPTQ_CACHE`` may point at a folder that holds other files); files it cannot
    stat or delete (another process got there first) are skipped."""
    now, entries = time.time(), []
    try:
        paths = list(folder.iterdir())
    except OSError:
        return 0, 0
    for path in paths:
        kind = _ENTRY_NAME.fullmatch(path.name)
        if kind is None:
            continue
        try:
            stat = path.stat()
            if kind.group(1) and now - stat.st_mtime > STALE_TMP_SECONDS:
                path.unlink()
        except OSError:
            continue
        if not kind.group(1):
            entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    deleted = freed = 0
    for _, size, path in sorted(entries, key=lambda entry: entry[0]):  # oldest use first
        if total <= limit:
            break
        if path == keep:
            continue
        try:
            path.unlink()
        except OSError:
            continue
        total -= size
        deleted, freed = deleted + 1, freed + size
    return deleted, freed
