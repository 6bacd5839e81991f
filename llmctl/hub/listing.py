"""``llmctl ls``: the cached snapshots (``scan_cache_dir``) with facts read from ``config.json`` and
the safetensors headers, or a GGUF file's header and tensor infos, alone (no weight is read)."""

from __future__ import annotations

import json
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.errors import HubError
from llmctl.hub.layout import hub_cache_dir, snapshot_gguf_files, snapshot_is_complete, snapshot_weight_files
from llmctl.models import registry

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
# the quant label in a GGUF file name ("SmolLM2-135M-Instruct.Q4_1.gguf" -> Q4_1), for REPO:TAG
_GGUF_LABEL = re.compile(r"(?:^|[-._])((?:I?Q\d+(?:_[A-Z0-9]+)*)|BF16|F16|F32)(?=[-.])", re.IGNORECASE)


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
    weight_bytes: int | None = None  # what the weights take as stored (from the headers)
    gguf_file: str | None = None  # a GGUF snapshot: one row per file

    @property
    def runs_here(self) -> bool | None:
        """Whether llmctl implements the architecture (llmctl.models.registry); None when unknown."""
        return architecture_runs_here(self.architecture, gguf=self.gguf_file is not None)

    @property
    def name(self) -> str:
        """``repo_id``, or for a GGUF file ``repo_id:TAG`` (what ``llmctl generate`` takes)."""
        if self.gguf_file is None:
            return self.repo_id
        found = _GGUF_LABEL.findall(self.gguf_file.removesuffix(".gguf") + ".")
        return f"{self.repo_id}:{found[-1] if found else self.gguf_file}"

    @property
    def bytes_per_parameter(self) -> float | None:
        if not self.weight_bytes or not self.num_parameters:
            return None
        return self.weight_bytes / self.num_parameters

    @property
    def revision(self) -> str:
        """The refs pointing at this snapshot (``main``, a tag) or, if none, the short commit."""
        return ", ".join(self.refs) if self.refs else self.commit[:12]

    @property
    def revisions(self) -> tuple[str, ...]:
        return self.refs


def architecture_runs_here(architecture: str | None, *, gguf: bool) -> bool | None:
    """Whether the registry has a family for a config's architecture (or model_type) or a GGUF
    file's ``general.architecture``; None when the architecture is unknown."""
    if architecture is None:
        return None
    if gguf:
        return registry.family_for_gguf(architecture) is not None
    return registry.family_for(architecture) is not None or registry.family_for_model_type(architecture) is not None


def pulled_architecture(path: Path) -> tuple[str | None, bool]:
    """The architecture of what ``pull`` returned (a snapshot dir or one GGUF file), and whether
    it is a GGUF file."""
    if path.suffix == ".gguf":
        return _gguf_rows_for([path])[0].get("architecture"), True
    return _model_facts(path)[0], False


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


def safetensors_bytes(files: list[Path]) -> int:
    """Bytes of the tensors' data, from the headers' offsets."""
    total = 0
    for path in files:
        for name, entry in _safetensors_header(path).items():
            if name != "__metadata__" and isinstance(entry, dict):
                start, end = entry.get("data_offsets", (0, 0))
                total += int(end) - int(start)
    return total


def _gguf_rows(base: dict[str, Any], snapshot: Path) -> list[CachedModel]:
    """One row per GGUF file of a snapshot without config.json."""
    files = snapshot_gguf_files(snapshot)
    return [
        CachedModel(**base, **found, complete=True, gguf_file=path.name)
        for path, found in zip(files, _gguf_rows_for(files))
    ]


def _gguf_rows_for(files: list[Path]) -> list[dict[str, Any]]:
    """What each GGUF file's header says (architecture, parameters, dtype, bytes), read alone."""
    from llmctl.errors import LlmctlError
    from llmctl.models.gguf_reader import gguf_summary

    rows: list[dict[str, Any]] = []
    for path in files:
        try:
            facts = gguf_summary(path)
            rows.append(
                dict(
                    architecture=facts.architecture,
                    num_parameters=facts.num_parameters,
                    dtype=facts.dtype,
                    weight_bytes=facts.weight_bytes,
                )
            )
        except (LlmctlError, OSError, ValueError):
            rows.append(dict(architecture=None, num_parameters=None, dtype=None))
    return rows


def _model_facts(snapshot: Path) -> tuple[str | None, int | None, str | None, bool, int | None]:
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
    weight_bytes: int | None = None
    weights = snapshot_weight_files(snapshot)
    if weights:
        try:
            num_parameters, dtype = safetensors_stats(weights)
            weight_bytes = safetensors_bytes(weights)
        except (OSError, ValueError, TypeError):
            num_parameters, dtype = None, None
    if dtype is None and isinstance(config_dtype, str):
        dtype = config_dtype
    return architecture, num_parameters, dtype, snapshot_is_complete(snapshot), weight_bytes


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
            base = dict(
                repo_id=repo.repo_id,
                commit=rev.commit_hash,
                refs=tuple(sorted(rev.refs)),
                size_on_disk=rev.size_on_disk,
                path=rev.snapshot_path,
            )
            if not (rev.snapshot_path / "config.json").is_file() and snapshot_gguf_files(rev.snapshot_path):
                models.extend(_gguf_rows(base, rev.snapshot_path))
                continue
            architecture, num_parameters, dtype, complete, weight_bytes = _model_facts(rev.snapshot_path)
            models.append(
                CachedModel(
                    **base,
                    architecture=architecture,
                    num_parameters=num_parameters,
                    dtype=dtype,
                    complete=complete,
                    weight_bytes=weight_bytes,
                )
            )
    models.sort(key=lambda m: (m.name.lower(), m.revision))
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
