"""MODEL arguments: a local directory, a cached hub id, or (when the user agrees) a pull."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from llmctl.errors import ModelNotFoundError
from llmctl.hub.download import pull
from llmctl.hub.layout import REPO_ID, hub_cache_dir, hub_endpoint
from llmctl.hub.refs import find_cached_model, has_incomplete_snapshot, parse_model_ref, split_gguf_tag

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console


def resolve_model_dir(spec: str, *, allow_pull: bool | None = None, console: Console | None = None) -> Path:
    """Turn a MODEL argument into a directory holding config.json and safetensors weights, or a GGUF
    file (or a snapshot holding one).

    - a local directory with config.json -> that directory;
    - ``ORG/NAME[@REV]`` in the HF cache -> its snapshot (no network); ``ORG/NAME[@REV]:TAG`` -> the
      cached GGUF file that TAG names (a snapshot of one GGUF file is loaded as that file);
    - otherwise ``allow_pull=True`` pulls it, ``None`` asks on an interactive terminal (and
      refuses with a hint elsewhere), ``False`` refuses: ``ModelNotFoundError``.
    The embedded default model is the caller's business, before calling this.
    """
    text = spec.strip()
    local = Path(text).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            return local
        raise ModelNotFoundError(f"directory {local} has no config.json, so it is not a model directory")
    if local.exists():
        raise ModelNotFoundError(f"{local} is a file; MODEL must be a model directory or a hub id ORG/NAME[@REVISION]")
    if text.startswith(("/", "./", "../", "~", ".\\")) or (os.sep != "/" and os.sep in text):
        raise ModelNotFoundError(f"no such model directory: {local}")

    untagged, tag = split_gguf_tag(text)
    repo_id, revision = parse_model_ref(untagged)
    if not REPO_ID.match(repo_id) or "--" in repo_id or ".." in repo_id:
        raise ModelNotFoundError(
            f"{spec!r} is neither a model directory (with config.json) nor a hub id ORG/NAME[@REVISION]"
        )
    cached = find_cached_model(repo_id, revision, tag)
    if cached is not None:
        return cached

    where = f"{repo_id}@{revision}" if revision else repo_id
    incomplete = has_incomplete_snapshot(repo_id)  # what `llmctl ls` shows as "(incomplete)"
    if allow_pull is None:
        if sys.stdin is not None and sys.stdin.isatty():
            from rich.prompt import Confirm

            state = "is in the Hugging Face cache but incomplete" if incomplete else "is not in the Hugging Face cache"
            verb = "Complete the download" if incomplete else "Download it"
            if Confirm.ask(f"{where} {state}. {verb} from {hub_endpoint()}?", default=True, console=console):
                allow_pull = True
            else:
                raise ModelNotFoundError(f"{where} is not downloaded (declined); `llmctl pull {text}` fetches it")
        else:
            allow_pull = False
    if allow_pull:
        return pull(text, console=console)
    if incomplete:
        raise ModelNotFoundError(
            f"model {text!r} is in the Hugging Face cache ({hub_cache_dir()}) but incomplete (config.json or "
            f"safetensors weights missing, e.g. an interrupted download); run `llmctl pull {text}` to complete it"
        )
    raise ModelNotFoundError(
        f"model {text!r} is not a local directory and not in the Hugging Face cache ({hub_cache_dir()}); "
        f"run `llmctl pull {text}` first"
    )
