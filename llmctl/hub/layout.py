"""Where things are: the Hugging Face cache that ``huggingface_hub`` itself uses, its layout
(``models--org--name/{blobs,snapshots/<commit>,refs}``), and which of a repo's files inference needs.

The environment is read at call time: ``huggingface_hub.constants`` freezes it at import time,
and tests (and users) change ``HF_ENDPOINT`` / ``HF_HUB_CACHE`` after that.
"""

from __future__ import annotations

import fnmatch
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
GGUF_SUFFIX = ".gguf"
# What a GGUF repo without a tag gives, as llama.cpp and Ollama choose: this quant where present.
DEFAULT_GGUF_TAG = "Q4_K_M"


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


def gguf_files(filenames: list[str]) -> list[str]:
    """The top-level model GGUF files of a repo (vision projectors, ``mmproj*``, left out)."""
    return sorted(
        f for f in filenames if "/" not in f and f.lower().endswith(GGUF_SUFFIX) and not f.lower().startswith("mmproj")
    )


def gguf_tag_matches(filename: str, tag: str) -> bool:
    """Whether a GGUF file is the one ``REPO:TAG`` names (llama.cpp's and Ollama's syntax): the tag
    stands between separators in the name, case-insensitively, so ``Q4_K`` is not ``Q4_K_M``; the
    full file name is accepted too."""
    if filename.lower() == tag.lower():
        return True
    return re.search(rf"(?:^|[-._]){re.escape(tag)}(?:[-.]|$)", filename, re.IGNORECASE) is not None


def select_gguf_file(filenames: list[str], tag: str | None, include: str | None, where: str) -> str:
    """The one GGUF file to fetch: the one ``include`` (a glob) or ``tag`` names; without either the
    only one, else the ``Q4_K_M`` one. ``ValueError`` (with the choices) when that is not one file."""
    candidates = gguf_files(filenames)
    if not candidates:
        raise ValueError(f"{where} has no .gguf files")
    if include is not None:
        chosen = [f for f in candidates if fnmatch.fnmatch(f, include)]
        asked = f"--include {include!r}"
    elif tag is not None:
        chosen = [f for f in candidates if gguf_tag_matches(f, tag)]
        asked = f"tag {tag!r}"
    else:
        chosen = (
            candidates if len(candidates) == 1 else [f for f in candidates if gguf_tag_matches(f, DEFAULT_GGUF_TAG)]
        )
        asked = f"no tag (default {DEFAULT_GGUF_TAG})"
    if len(chosen) == 1:
        return chosen[0]
    listing = ", ".join(candidates[:12]) + (", ..." if len(candidates) > 12 else "")
    if not chosen:
        raise ValueError(
            f"{where}: {asked} matches none of its GGUF files ({listing}); "
            "choose one with REPO:TAG (e.g. :Q4_K_M) or --include PATTERN"
        )
    raise ValueError(
        f"{where}: {asked} matches {len(chosen)} GGUF files ({', '.join(chosen[:6])}); "
        "llmctl loads one single-file GGUF: name it with REPO:TAG or --include PATTERN"
    )


def snapshot_gguf_files(snapshot: Path) -> list[Path]:
    return [snapshot / name for name in gguf_files([p.name for p in snapshot.glob("*" + GGUF_SUFFIX) if p.is_file()])]


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
    """A snapshot llmctl can load: config.json and all its safetensors weights, or a GGUF file
    (self-contained: config, tokenizer and weights) are present."""
    if not (snapshot / "config.json").is_file():
        return bool(snapshot_gguf_files(snapshot))
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
