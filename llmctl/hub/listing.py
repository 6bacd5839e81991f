"""``llmctl ls``: the cached snapshots (``scan_cache_dir``) with facts read from ``config.json`` and
the safetensors headers alone (no weight is read)."""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.errors import HubError
from llmctl.hub.layout import hub_cache_dir, snapshot_is_complete, snapshot_weight_files

_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}
_MAX_SAFETENSORS_HEADER = 100_000_000


@dataclass(frozen=True)
class CachedModel:
    """One cached revision (snapshot) of a model repo."""

    repo_id: str
    commit: str
    refs: tuple[str, ...]
    size_on_disk: int
    path: Path
    architecture: str | None
    num_parameters: int | None
    dtype: str | None
    complete: bool

    @property
    def revision(self) -> str:
        """The refs pointing at this snapshot (``main``, a tag) or, if none, the short commit."""
        return ", ".join(self.refs) if self.refs else self.commit[:12]

    @property
    def revisions(self) -> tuple[str, ...]:
        return self.refs


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_SAFETENSORS_HEADER:
            raise ValueError(f"{path}: safetensors header of {length} bytes is implausible")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    return header


def safetensors_stats(files: list[Path]) -> tuple[int, str | None]:
    """(parameter count, dtype) from the safetensors headers alone; no weight is read.

    The dtype is the one holding most parameters; others follow after '+' (e.g. ``bfloat16+float32``).
    """
    counts: Counter[str] = Counter()
    for path in files:
        for name, entry in _safetensors_header(path).items():
            if name == "__metadata__" or not isinstance(entry, dict):
                continue
            numel = 1
            for dim in entry.get("shape", []):
                numel *= int(dim)
            dtype = str(entry.get("dtype", "?"))
            counts[_SAFETENSORS_DTYPES.get(dtype, dtype.lower())] += numel
    total = sum(counts.values())
    dtype = "+".join(name for name, _ in counts.most_common()) if counts else None
    return total, dtype


def _model_facts(snapshot: Path) -> tuple[str | None, int | None, str | None, bool]:
    architecture: str | None = None
    config_dtype: str | None = None
    try:
        config = json.loads((snapshot / "config.json").read_text())
        archs = config.get("architectures") or []
        architecture = str(archs[0]) if archs else (config.get("model_type") or None)
        config_dtype = config.get("torch_dtype") or config.get("dtype")
    except (OSError, ValueError, AttributeError):
        pass
    num_parameters: int | None = None
    dtype: str | None = None
    weights = snapshot_weight_files(snapshot)
    if weights:
        try:
            num_parameters, dtype = safetensors_stats(weights)
        except (OSError, ValueError, TypeError):
            num_parameters, dtype = None, None
    if dtype is None and isinstance(config_dtype, str):
        dtype = config_dtype
    return architecture, num_parameters, dtype, snapshot_is_complete(snapshot)


def list_models() -> list[CachedModel]:
    """Every cached snapshot of a model repo in the HF cache, with facts read from config/safetensors headers."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    cache = hub_cache_dir()
    try:
        info = scan_cache_dir(cache)
    except (CacheNotFound, FileNotFoundError):
        return []
    except ValueError as exc:
        raise HubError(f"cannot read the Hugging Face cache {cache}: {exc}") from exc
    models: list[CachedModel] = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            architecture, num_parameters, dtype, complete = _model_facts(rev.snapshot_path)
            models.append(
                CachedModel(
                    repo_id=repo.repo_id,
                    commit=rev.commit_hash,
                    refs=tuple(sorted(rev.refs)),
                    size_on_disk=rev.size_on_disk,
                    path=rev.snapshot_path,
                    architecture=architecture,
                    num_parameters=num_parameters,
                    dtype=dtype,
                    complete=complete,
                )
            )
    models.sort(key=lambda m: (m.repo_id.lower(), m.revision))
    return models


def partial_downloads() -> dict[str, int]:
    """repo_id -> bytes of ``blobs/*.incomplete`` files (interrupted downloads) in the cache."""
    cache = hub_cache_dir()
    out: dict[str, int] = {}
    if not cache.is_dir():
        return out
    for path in cache.glob("models--*/blobs/*.incomplete"):
        repo_id = path.parent.parent.name[len("models--") :].replace("--", "/")
        try:
            out[repo_id] = out.get(repo_id, 0) + path.stat().st_size
        except OSError:
            continue
    return out

