"""Where things are: the Hugging Face cache that ``huggingface_hub`` itself uses, its layout
(``models--org--name/{blobs,snapshots/<commit>,refs}``), and which of a repo's files inference needs.

The environment is read at call time: ``huggingface_hub.constants`` freezes it at import time,
and tests (and users) change ``HF_ENDPOINT`` / ``HF_HUB_CACHE`` after that.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"

FULL_COMMIT = re.compile(r"^[0-9a-f]{40}$")
COMMIT_PREFIX = re.compile(r"^[0-9a-f]{7,40}$")

# huggingface_hub's own rule for repo ids ("name" or "namespace/name").
REPO_ID = re.compile(r"^(?:[\w.\-]{1,96}/)?[\w.\-]{1,96}$")

# Top-level files inference needs, besides the safetensors weights.
_CONFIG_FILES = ("config.json", "generation_config.json")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
INDEX_FILE = "model.safetensors.index.json"
_SINGLE_WEIGHTS = "model.safetensors"


def hub_endpoint() -> str:
    """The hub to talk to: ``HF_ENDPOINT`` (a mirror, or a test server) or huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_cache_dir() -> Path:
    """The huggingface_hub cache: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def user_agent() -> dict[str, str]:
    """library_name/library_version for huggingface_hub's user-agent header."""
    from llmctl import __version__

    return {"library_name": "llmctl", "library_version": __version__}


def offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def endpoint_label() -> str:
    if os.environ.get("HF_ENDPOINT"):
        return f"HF_ENDPOINT={os.environ['HF_ENDPOINT']}"
    return f"HF_ENDPOINT is unset, so the default {DEFAULT_ENDPOINT}"


def repo_folder(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def repo_storage(repo_id: str, cache: Path | None = None) -> Path:
    return (cache or hub_cache_dir()) / repo_folder(repo_id)


def _is_wanted_small_file(name: str) -> bool:
    return name in _CONFIG_FILES or name in _TOKENIZER_FILES


def select_inference_files(filenames: list[str], weight_map_files: list[str] | None = None) -> list[str]:
    """The subset of a repo's files that inference needs, in download order (config.json last).

    ``weight_map_files`` are the shards named by ``model.safetensors.index.json`` (when the repo
    has one and it has been read). Only top-level files are considered; ``*.bin``, ``*.pt``,
    ``*.onnx``, ``*.gguf``, ``README.md``, ``.gitattributes``, licences and sub-folders are skipped.
    A ``consolidated.safetensors`` next to the transformers shards is skipped too.
    """
    top = [f for f in filenames if "/" not in f]
    present = set(top)
    if weight_map_files is not None:
        weights = sorted(set(weight_map_files))
        if INDEX_FILE in present:
            weights.insert(0, INDEX_FILE)
    elif _SINGLE_WEIGHTS in present:
        weights = [_SINGLE_WEIGHTS]
    else:
        weights = sorted(f for f in top if f.endswith(".safetensors"))
    small = [f for f in top if _is_wanted_small_file(f) and f != "config.json"]
    ordered = weights + sorted(small)
    if "config.json" in present:
        ordered.append("config.json")  # last: a snapshot with config.json has everything else
    return ordered


def snapshot_weight_files(snapshot: Path) -> list[Path] | None:
    """The safetensors files of a snapshot (None if the index names a missing shard)."""
    index = snapshot / INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        paths = [snapshot / n for n in names]
        return paths if all(p.is_file() for p in paths) else None
    single = snapshot / _SINGLE_WEIGHTS
    if single.is_file():
        return [single]
    return sorted(p for p in snapshot.glob("*.safetensors") if p.is_file())


def snapshot_is_complete(snapshot: Path) -> bool:
    """A snapshot llmctl can load: config.json and all its safetensors weights are present."""
    if not (snapshot / "config.json").is_file():
        return False
    weights = snapshot_weight_files(snapshot)
    return bool(weights)


def write_ref(storage: Path, revision: str, commit: str) -> None:
    """refs/<revision> -> commit, as huggingface_hub does (atomically; nothing for a full commit hash)."""
    if revision == commit:
        return
    ref_path = storage / "refs" / revision
    ref_path.parent.mkdir(parents=True, exist_ok=True)
    if ref_path.is_file() and ref_path.read_text().strip() == commit:
        return
    tmp = ref_path.with_name(f"{ref_path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(commit)
    os.replace(tmp, ref_path)

