"""Models from the Hugging Face hub: ``llmctl pull / ls / rm`` on the standard HF cache.

Everything lives in the cache that ``huggingface_hub`` itself uses (``HF_HUB_CACHE``, else
``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), in its usual layout
(``models--org--name/{blobs,snapshots/<commit>,refs}``), so models that transformers, vLLM or
``hf download`` already fetched are reused, and what llmctl fetches is reused by them.

What ``pull`` does (see ``docs/hub.md``):

1. ``HfApi.model_info(files_metadata=True)`` resolves the revision to a commit and lists the
   files with their git blob id and LFS sha256.
2. Only the files inference needs are selected: ``config.json``, ``generation_config.json``, the
   tokenizer files and the safetensors weights (the shards named by
   ``model.safetensors.index.json`` when there is one). ``*.bin``, ``*.onnx``, ``README.md``,
   sub-folders and so on are never requested.
3. Each missing file is HEAD-ed (``get_hf_file_metadata``: ETag, size, download location) and
   streamed with huggingface_hub's own ``http_get`` into ``blobs/<etag>.incomplete``, a stable
   name, so an interrupted pull resumes with an HTTP ``Range`` request, both within a run
   (``http_get`` retries a dropped connection itself) and across runs (huggingface_hub 2.4 deletes
   its own, per-process ``.incomplete`` files when a download fails, so it cannot resume across runs).
4. The bytes are hashed while they are written and compared with the checksum the hub lists
   (sha256 for LFS files, the git blob sha1 otherwise). A mismatch deletes the file and raises
   ``HubError``; nothing unverified is moved into ``blobs/``. huggingface_hub 2.4 only checks the
   size of plain HTTP downloads, never a checksum.
5. The verified blob is linked into ``snapshots/<commit>/`` by ``hf_hub_download`` (which finds
   the blob in place and only creates the symlink), ``config.json`` last, and ``refs/<revision>``
   is written once every file is in place. Files stored with Xet (large files on huggingface.co
   when ``hf_xet`` is installed) are fetched by ``hf_hub_download`` itself and verified after.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import sys
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator
from urllib.parse import urlsplit

from rich.markup import escape

from llmctl.errors import HubError, LlmctlError, ModelNotFoundError

if TYPE_CHECKING:  # pragma: no cover
    import typer
    from rich.console import Console

__all__ = [
    "CachedModel",
    "find_cached_snapshot",
    "hub_cache_dir",
    "hub_endpoint",
    "list_models",
    "parse_model_ref",
    "pull",
    "register_hub_commands",
    "remove",
    "resolve_model_dir",
    "select_inference_files",
]

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"

_FULL_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_COMMIT_PREFIX = re.compile(r"^[0-9a-f]{7,40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# huggingface_hub's own rule for repo ids ("name" or "namespace/name").
_REPO_ID = re.compile(r"^(?:[\w.\-]{1,96}/)?[\w.\-]{1,96}$")

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
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_WEIGHTS = "model.safetensors"

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


# --------------------------------------------------------------------------------------------
# Environment: read at call time (huggingface_hub.constants freezes them at import time).
# --------------------------------------------------------------------------------------------


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


def _ua() -> dict[str, str]:
    """library_name/library_version for huggingface_hub's user-agent header."""
    from llmctl import __version__

    return {"library_name": "llmctl", "library_version": __version__}


def _offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _endpoint_label() -> str:
    if os.environ.get("HF_ENDPOINT"):
        return f"HF_ENDPOINT={os.environ['HF_ENDPOINT']}"
    return f"HF_ENDPOINT is unset, so the default {DEFAULT_ENDPOINT}"


def _repo_folder(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def _storage(repo_id: str, cache: Path | None = None) -> Path:
    return (cache or hub_cache_dir()) / _repo_folder(repo_id)


# --------------------------------------------------------------------------------------------
# Model references
# --------------------------------------------------------------------------------------------


def parse_model_ref(ref: str) -> tuple[str, str | None]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; ``"org/name"`` -> ``("org/name", None)``.

    A leading ``hf://`` or ``https://huggingface.co/`` is accepted and dropped.
    """
    text = ref.strip()
    for prefix in ("hf://", "https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
            break
    repo_id, sep, revision = text.partition("@")
    repo_id = repo_id.strip().strip("/")
    if not repo_id:
        raise ModelNotFoundError(f"empty model name in {ref!r}: expected ORG/NAME or ORG/NAME@REVISION")
    if sep and not revision.strip():
        raise ModelNotFoundError(f"empty revision after '@' in {ref!r}: expected ORG/NAME@REVISION")
    return repo_id, (revision.strip() if sep else None)


def _check_repo_id(repo_id: str, ref: str) -> None:
    if not _REPO_ID.match(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        raise ModelNotFoundError(
            f"{ref!r} is not a Hugging Face repo id: expected ORG/NAME[@REVISION] with letters, digits, '-', '_' or '.'"
        )


# --------------------------------------------------------------------------------------------
# Which files inference needs
# --------------------------------------------------------------------------------------------


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
        if _INDEX_FILE in present:
            weights.insert(0, _INDEX_FILE)
    elif _SINGLE_WEIGHTS in present:
        weights = [_SINGLE_WEIGHTS]
    else:
        weights = sorted(f for f in top if f.endswith(".safetensors"))
    small = [f for f in top if _is_wanted_small_file(f) and f != "config.json"]
    ordered = weights + sorted(small)
    if "config.json" in present:
        ordered.append("config.json")  # last: a snapshot with config.json has everything else
    return ordered


# --------------------------------------------------------------------------------------------
# Errors: huggingface_hub / network exceptions -> one actionable line
# --------------------------------------------------------------------------------------------


def _network_errors() -> tuple[type[BaseException], ...]:
    """Connection-level exception classes of whichever HTTP client huggingface_hub uses."""
    found: list[type[BaseException]] = []
    for module_name in ("httpx2", "httpx"):
        try:
            module = __import__(module_name)
        except ImportError:
            continue
        for name in ("ConnectError", "TimeoutException", "RemoteProtocolError", "NetworkError", "ProxyError"):
            cls = getattr(module, name, None)
            if isinstance(cls, type):
                found.append(cls)
    try:
        import requests  # type: ignore[import-untyped]

        found += [requests.ConnectionError, requests.Timeout]
    except ImportError:
        pass
    return tuple(found)


def _is_unreachable(exc: BaseException) -> bool:
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(exc, OfflineModeIsEnabled) or isinstance(exc, _network_errors()):
        return True
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return status is not None and status >= 500
    return False


def _status(exc: BaseException) -> int | None:
    return getattr(getattr(exc, "response", None), "status_code", None)


def _translate(
    exc: BaseException,
    *,
    repo_id: str,
    revision: str | None,
    token: str | None,
    filename: str | None = None,
) -> LlmctlError:
    """An actionable ``HubError`` for what huggingface_hub (or the network) raised."""
    from huggingface_hub import errors as hfe

    endpoint = hub_endpoint()
    rev = revision or DEFAULT_REVISION
    what = f"{filename} of {repo_id}@{rev}" if filename else f"{repo_id}@{rev}"
    if isinstance(exc, LlmctlError):
        return exc
    if isinstance(exc, hfe.OfflineModeIsEnabled):
        return HubError(
            f"HF_HUB_OFFLINE is set, so {repo_id} cannot be downloaded from {endpoint}; "
            "unset HF_HUB_OFFLINE or use a model already in the cache (`llmctl ls`)"
        )
    if isinstance(exc, hfe.GatedRepoError):
        hint = (
            "the token in use has no access: accept the licence on the model page with that account"
            if token or os.environ.get("HF_TOKEN")
            else "accept its licence on the model page, then set HF_TOKEN (or pass --token) to a token of that account"
        )
        return HubError(f"{repo_id} is a gated repository on {endpoint}: {hint}")
    if isinstance(exc, hfe.RepositoryNotFoundError):
        return HubError(
            f"repository {repo_id} not found on {endpoint} (check the id, or HF_TOKEN for gated/private repos)"
        )
    if isinstance(exc, hfe.RevisionNotFoundError):
        return HubError(
            f"revision {rev!r} not found in {repo_id} on {endpoint} (check the branch, tag or commit after '@')"
        )
    if isinstance(exc, hfe.RemoteEntryNotFoundError):
        return HubError(f"{what} is listed by {endpoint} but could not be downloaded (404)")
    if isinstance(exc, _network_errors()):
        reason = str(exc) or type(exc).__name__
        return HubError(
            f"could not reach the Hugging Face hub at {endpoint} ({_endpoint_label()}): {reason}; "
            "check the network connection or HF_ENDPOINT (models already in the cache still work: `llmctl ls`)"
        )
    if isinstance(exc, hfe.HfHubHTTPError):
        status = _status(exc)
        if status == 401:
            return HubError(
                f"{endpoint} refused the credentials for {what} (HTTP 401): check HF_TOKEN / --token"
            )
        if status == 403:
            return HubError(
                f"{endpoint} denied access to {what} (HTTP 403): the token lacks permission; "
                "for a gated model accept its licence on the model page"
            )
        if status == 404:
            return HubError(
                f"repository {repo_id} (revision {rev!r}) not found on {endpoint} "
                "(check the id, or HF_TOKEN for gated/private repos)"
            )
        if status == 429:
            return HubError(f"{endpoint} is rate-limiting requests (HTTP 429); wait a minute and retry")
        if status is not None and status >= 500:
            return HubError(f"{endpoint} failed with HTTP {status} while fetching {what}; retry later")
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return HubError(f"{endpoint} refused {what}: {first_line}")
    if isinstance(exc, json.JSONDecodeError):
        return HubError(
            f"{endpoint} did not answer like a Hugging Face hub (no JSON from its API) for {what}; check HF_ENDPOINT"
        )
    if isinstance(exc, hfe.HFValidationError):
        return ModelNotFoundError(f"{repo_id!r} is not a valid Hugging Face repo id: {exc}")
    if isinstance(exc, OSError):
        return HubError(f"could not write {what} to the cache {hub_cache_dir()}: {exc}")
    return HubError(f"unexpected error while fetching {what} from {endpoint}: {type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------------------------
# Progress: rich bars driven by the tqdm-like objects huggingface_hub instantiates
# --------------------------------------------------------------------------------------------


def _bar_class(on_progress: Callable[[int], None] | None) -> type:
    """A tqdm stand-in for huggingface_hub's ``tqdm_class`` hooks.

    ``http_get`` creates it with ``total=``/``initial=`` (the resumed byte count) and calls
    ``update(len(chunk))`` per chunk written, ``update(-n)`` when a server ignored a Range request.
    The Xet downloader sees ``update_transfer`` and reports written bytes through ``update`` too.
    ``on_progress`` receives the absolute number of bytes of the file on disk.
    """

    class _Bar:
        def __init__(self, *args: Any, total: int | None = None, initial: int = 0, **kwargs: Any) -> None:
            self.n = 0
            self.total = total
            self.disable = on_progress is None
            if initial:
                self.update(initial)

        def update(self, n: int | float | None = 1) -> None:
            if n:
                self.n += int(n)
                if on_progress is not None:
                    on_progress(self.n)

        def update_transfer(self, n: int | float | None = 1) -> None:  # network bytes: not shown
            pass

        def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
            pass

        set_transfer_postfix_str = set_description = set_description_str = set_postfix_str

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            pass

        def close(self) -> None:
            pass

        def __enter__(self) -> "_Bar":
            return self

        def __exit__(self, *exc: Any) -> bool:
            return False

    return _Bar


class _PullProgress:
    """One rich bar per file plus an overall bar, in real bytes."""

    def __init__(self, console: "Console", enabled: bool, title: str, total: int) -> None:
        self._done: dict[str, int] = {}
        self._progress = None
        self._overall = None
        self._tasks: dict[str, Any] = {}
        self._current: str | None = None
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description}", markup=True),
            BarColumn(bar_width=28),
            TaskProgressColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
            refresh_per_second=8,
        )
        self._overall = self._progress.add_task(f"[bold]{escape(title)}", total=total or None, completed=0)

    def __enter__(self) -> "_PullProgress":
        if self._progress is not None:
            self._progress.start()
            # http_get logs "Error while downloading ... Trying to resume download..." when a connection
            # drops and it retries with a Range request: show that in the bars instead of raw log lines.
            self._logger = logging.getLogger("huggingface_hub.file_download")
            self._logger.addFilter(self._log_filter)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._logger.removeFilter(self._log_filter)
            self._progress.stop()

    def _log_filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno < logging.WARNING or not message.startswith("Error while downloading"):
            return True
        assert self._progress is not None
        name = self._current or "a file"
        reason = message.split(": ", 1)[-1].splitlines()[0]
        done = self._done.get(name, 0)
        if "Trying to resume" in message:
            self._progress.console.print(
                f"[yellow]connection dropped[/yellow] while downloading {escape(name)} ({escape(reason)}); "
                f"resuming with a Range request from byte {done}",
                highlight=False,
                soft_wrap=True,
            )
            self.describe(name, f"{escape(name)} [yellow](resuming)[/yellow]")
        return False

    def start_file(self, name: str, size: int | None) -> Callable[[int], None] | None:
        if self._progress is None:
            return None
        task = self._progress.add_task(f"  {escape(name)}", total=size or None, completed=0)
        self._tasks[name] = task
        self._current = name

        def on_progress(done: int) -> None:
            self._done[name] = done
            assert self._progress is not None
            self._progress.update(task, completed=done)
            self._progress.update(self._overall, completed=sum(self._done.values()))

        return on_progress

    def describe(self, name: str, text: str) -> None:
        if self._progress is not None and name in self._tasks:
            self._progress.update(self._tasks[name], description=f"  {text}")

    def finish_file(self, name: str, size: int | None) -> None:
        if self._progress is not None and name in self._tasks:
            if size is not None:
                self._done[name] = size
                self._progress.update(self._tasks[name], completed=size, total=size)
                self._progress.update(self._overall, completed=sum(self._done.values()))
            self._progress.update(self._tasks[name], description=f"  [green]✓[/green] {escape(name)}")


# --------------------------------------------------------------------------------------------
# Checksums
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Checksum:
    kind: str  # "sha256" (LFS files) or "git-sha1" (git blob id of regular files)
    value: str
    size: int | None

    def new(self) -> "hashlib._Hash":
        if self.kind == "sha256":
            return hashlib.sha256()
        h = hashlib.sha1()
        h.update(b"blob %d\0" % (self.size or 0))
        return h


def _expected_checksum(sibling: Any, etag: str, size: int | None) -> _Checksum | None:
    """What the hub says the file must hash to: LFS sha256, else the git blob id."""
    lfs = getattr(sibling, "lfs", None)
    if lfs is not None and getattr(lfs, "sha256", None):
        return _Checksum("sha256", str(lfs.sha256).lower(), getattr(lfs, "size", None) or size)
    blob_id = getattr(sibling, "blob_id", None)
    if blob_id and size is not None and re.fullmatch(r"[0-9a-f]{40}", str(blob_id)):
        return _Checksum("git-sha1", str(blob_id), size)
    if _SHA256.match(etag):  # the hub names LFS blobs by their sha256
        return _Checksum("sha256", etag, size)
    return None


class _HashingFile:
    """A binary file wrapper that hashes what ``http_get`` writes (resumed bytes are hashed first)."""

    def __init__(self, raw: Any, path: Path, checksum: _Checksum | None) -> None:
        self._raw = raw
        self._path = path
        self._checksum = checksum
        self._hash = checksum.new() if checksum else None
        self._rehash(raw.tell())

    def _rehash(self, upto: int) -> None:
        if self._checksum is None:
            return
        self._hash = self._checksum.new()
        self._raw.flush()
        remaining = upto
        with open(self._path, "rb") as f:
            while remaining > 0:
                chunk = f.read(min(remaining, 8 << 20))
                if not chunk:
                    break
                self._hash.update(chunk)
                remaining -= len(chunk)

    def write(self, data: bytes) -> int:
        if self._hash is not None:
            self._hash.update(data)
        return self._raw.write(data)

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        result = self._raw.truncate(size)
        self._rehash(self._raw.tell() if size is None else size)
        return result

    def flush(self) -> None:
        self._raw.flush()

    def hexdigest(self) -> str | None:
        return self._hash.hexdigest() if self._hash is not None else None


def _hash_file(path: Path, checksum: _Checksum) -> str:
    h = checksum.new()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _corrupted(repo_id: str, revision: str, filename: str, checksum: _Checksum, got: str, ref: str) -> HubError:
    return HubError(
        f"checksum mismatch for {filename} of {repo_id}@{revision}: expected {checksum.kind} "
        f"{checksum.value[:16]}…, got {got[:16]}…; the corrupted download was deleted, "
        f"run `llmctl pull {ref}` to fetch it again"
    )


# --------------------------------------------------------------------------------------------
# pull
# --------------------------------------------------------------------------------------------


@dataclass
class _FilePlan:
    name: str
    sibling: Any
    etag: str = ""
    size: int | None = None
    location: str = ""
    xet: bool = False
    blob_present: bool = False
    partial: int = 0


def pull(
    ref: str,
    *,
    token: str | None = None,
    console: "Console | None" = None,
    progress: bool = True,
) -> Path:
    """Download what inference needs of ``ORG/NAME[@REVISION]`` into the HF cache; return the snapshot dir.

    Already-cached files are not downloaded again; a partial file from an interrupted pull is
    resumed with a Range request; every downloaded file is checked against the hub's checksum.
    ``token`` defaults to ``HF_TOKEN`` (or the token saved by ``hf auth login``).
    Raises ``HubError`` (unreachable endpoint, missing repo or revision, gated repo, checksum
    mismatch) or ``ModelNotFoundError`` (malformed id).
    """
    from rich.console import Console

    repo_id, revision = parse_model_ref(ref)
    _check_repo_id(repo_id, ref)
    rev = revision or DEFAULT_REVISION
    console = console or Console(stderr=True)
    token = token or None
    endpoint = hub_endpoint()

    if revision is not None and _FULL_COMMIT.match(revision):
        cached = find_cached_snapshot(repo_id, revision)
        if cached is not None:  # a commit never changes: nothing to ask the hub
            if progress:
                console.print(f"{repo_id}@{revision[:12]} is already in the cache: {escape(str(cached))}", highlight=False)
            return cached

    if _offline():
        cached = find_cached_snapshot(repo_id, revision)
        if cached is not None:
            if progress:
                console.print(
                    f"HF_HUB_OFFLINE is set: using the cached {repo_id}@{rev} ({escape(str(cached))})", highlight=False
                )
            return cached
        raise HubError(
            f"HF_HUB_OFFLINE is set and {repo_id}@{rev} is not in the cache {hub_cache_dir()}; "
            "unset HF_HUB_OFFLINE to download it"
        )

    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=endpoint, token=token, **_ua()).model_info(repo_id, revision=rev, files_metadata=True)
    except Exception as exc:  # noqa: BLE001 - translated below
        if _is_unreachable(exc):
            cached = find_cached_snapshot(repo_id, revision)
            if cached is not None:
                console.print(
                    f"[yellow]warning:[/yellow] {escape(str(_translate(exc, repo_id=repo_id, revision=revision, token=token)))}; "
                    f"using the cached snapshot {escape(str(cached))}",
                    highlight=False,
                    soft_wrap=True,
                )
                return cached
        raise _translate(exc, repo_id=repo_id, revision=revision, token=token) from exc

    commit = getattr(info, "sha", None)
    if not commit:
        raise HubError(f"{endpoint} did not report a commit for {repo_id}@{rev}; is HF_ENDPOINT a Hugging Face hub?")
    siblings = {s.rfilename: s for s in (info.siblings or [])}
    cache = hub_cache_dir()
    storage = _storage(repo_id, cache)
    snapshot = storage / "snapshots" / commit

    if "config.json" not in siblings:
        raise HubError(
            f"{repo_id}@{rev} has no config.json at its top level; it is not a transformers-format model llmctl can load"
        )

    ctx = _PullContext(repo_id=repo_id, revision=rev, commit=commit, ref=ref, token=token, cache=cache)

    # Sharded weights: the index names the shards to fetch (and nothing else, e.g. no consolidated.safetensors).
    weight_map_files: list[str] | None = None
    if _INDEX_FILE in siblings:
        index_plan = ctx.plan(_INDEX_FILE, siblings[_INDEX_FILE], snapshot)
        if index_plan is not None:
            with _PullProgress(console, False, "", 0) as quiet:
                ctx.fetch(index_plan, quiet)
        weight_map_files = _weight_map_files(snapshot / _INDEX_FILE)
        missing = [f for f in weight_map_files if f not in siblings]
        if missing:
            raise HubError(
                f"{_INDEX_FILE} of {repo_id}@{rev} names shards the repo does not have: {', '.join(missing[:3])}"
            )

    wanted = select_inference_files(list(siblings), weight_map_files)
    if not any(f.endswith(".safetensors") for f in wanted):
        others = sorted(f for f in siblings if f.endswith((".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")))
        found = f" (it has {', '.join(others[:3])})" if others else ""
        raise HubError(f"{repo_id}@{rev} has no safetensors weights{found}; llmctl loads .safetensors only")

    plans = [p for name in wanted if (p := ctx.plan(name, siblings[name], snapshot)) is not None]
    cached_count = len(wanted) - len(plans)
    to_download = [p for p in plans if not p.blob_present]
    total = sum(p.size or 0 for p in to_download)
    resumed = sum(p.partial for p in to_download)

    if progress and not to_download:
        console.print(
            f"{repo_id}@{escape(rev)} (commit {commit[:12]}) is up to date in the cache ({len(wanted)} files)",
            highlight=False,
            soft_wrap=True,
        )
    elif progress:
        parts = [f"{len(to_download)} file(s) to download ({_fmt_size(total)})"]
        if resumed:
            parts.append(f"resuming {_fmt_size(resumed)} already downloaded")
        if cached_count:
            parts.append(f"{cached_count} already cached")
        console.print(
            f"Pulling [bold]{repo_id}[/bold]@{escape(rev)} (commit {commit[:12]}) from {escape(endpoint)}: " + ", ".join(parts),
            highlight=False,
            soft_wrap=True,
        )

    _check_disk_space(storage, total - resumed, f"{repo_id}@{rev}")
    title = f"{repo_id}@{rev}"
    with _PullProgress(console, progress and bool(to_download), title, total) as bars:
        for plan in plans:
            ctx.fetch(plan, bars)

    if not _snapshot_is_complete(snapshot):
        raise HubError(f"{repo_id}@{rev} was downloaded but {snapshot} is incomplete (config.json or weights missing)")
    _write_ref(storage, rev, commit)
    return snapshot


@dataclass
class _PullContext:
    repo_id: str
    revision: str
    commit: str
    ref: str
    token: str | None
    cache: Path

    @property
    def storage(self) -> Path:
        return _storage(self.repo_id, self.cache)

    def _translate(self, exc: BaseException, filename: str) -> LlmctlError:
        return _translate(exc, repo_id=self.repo_id, revision=self.revision, token=self.token, filename=filename)

    def plan(self, name: str, sibling: Any, snapshot: Path) -> _FilePlan | None:
        """HEAD the file unless the snapshot already has it; None when nothing is to be done."""
        pointer = snapshot / name
        if pointer.is_file():  # exists and, if a symlink, its blob too
            return None
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        url = hf_hub_url(self.repo_id, name, revision=self.commit, endpoint=hub_endpoint())
        try:
            meta = get_hf_file_metadata(url, token=self.token, endpoint=hub_endpoint(), **_ua())
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc, name) from exc
        if not meta.etag:
            raise HubError(f"{hub_endpoint()} sent no ETag for {name} of {self.repo_id}; is HF_ENDPOINT a Hugging Face hub?")
        etag = meta.etag
        size = meta.size
        if size is None:
            lfs = getattr(sibling, "lfs", None)
            size = getattr(lfs, "size", None) or getattr(sibling, "size", None)
        blob = self.storage / "blobs" / etag
        partial = blob.with_name(blob.name + ".incomplete")
        return _FilePlan(
            name=name,
            sibling=sibling,
            etag=etag,
            size=size,
            location=meta.location or url,
            xet=_use_xet(meta),
            blob_present=blob.is_file(),
            partial=partial.stat().st_size if partial.is_file() else 0,
        )

    def fetch(self, plan: _FilePlan, bars: _PullProgress) -> None:
        if plan.blob_present:
            self._link(plan.name)
            return
        on_progress = bars.start_file(plan.name, plan.size)
        try:
            if plan.xet:
                self._fetch_with_hf(plan, on_progress, bars)
            else:
                self._download_blob(plan, on_progress)
                self._link(plan.name)
        except BaseException:
            bars.describe(plan.name, f"[red]✗[/red] {escape(plan.name)}")
            raise
        bars.finish_file(plan.name, plan.size)

    def _link(self, name: str) -> Path:
        """Let hf_hub_download create snapshots/<commit>/<name> -> blobs/<etag> (the blob is in place)."""
        from huggingface_hub import hf_hub_download

        try:
            return Path(
                hf_hub_download(
                    self.repo_id,
                    name,
                    revision=self.commit,
                    cache_dir=self.cache,
                    endpoint=hub_endpoint(),
                    token=self.token,
                    tqdm_class=_bar_class(None),
                    **_ua(),
                )
            )
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc, name) from exc

    def _fetch_with_hf(self, plan: _FilePlan, on_progress: Callable[[int], None] | None, bars: _PullProgress) -> None:
        """Xet-stored files: hf_hub_download drives hf_xet (chunk-level dedup and cache), then we verify."""
        from huggingface_hub import hf_hub_download

        try:
            pointer = Path(
                hf_hub_download(
                    self.repo_id,
                    plan.name,
                    revision=self.commit,
                    cache_dir=self.cache,
                    endpoint=hub_endpoint(),
                    token=self.token,
                    tqdm_class=_bar_class(on_progress),
                    **_ua(),
                )
            )
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc, plan.name) from exc
        checksum = _expected_checksum(plan.sibling, plan.etag, plan.size)
        if checksum is None:
            return
        bars.describe(plan.name, f"{escape(plan.name)} (verifying {checksum.kind})")
        got = _hash_file(pointer, checksum)
        if got != checksum.value:
            blob = pointer.resolve()
            pointer.unlink(missing_ok=True)
            blob.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # no empty snapshots/<commit>/ left behind
                pointer.parent.rmdir()
            raise _corrupted(self.repo_id, self.revision, plan.name, checksum, got, self.ref)

    def _download_blob(self, plan: _FilePlan, on_progress: Callable[[int], None] | None) -> None:
        """Stream the file into blobs/<etag>.incomplete (resuming it), verify, move it to blobs/<etag>."""
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import WeakFileLock, build_hf_headers

        blobs = self.storage / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        blob = blobs / plan.etag
        partial = blobs / f"{plan.etag}.incomplete"
        lock = self.cache / ".locks" / _repo_folder(self.repo_id) / f"{plan.etag}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        checksum = _expected_checksum(plan.sibling, plan.etag, plan.size)

        headers = build_hf_headers(token=self.token, **_ua())
        if _host(plan.location) != _host(hub_endpoint()):
            headers.pop("authorization", None)  # a signed CDN url: the token stays on the hub

        with WeakFileLock(str(lock)):
            if blob.is_file():
                return
            for attempt in range(2):
                resume = partial.stat().st_size if partial.is_file() else 0
                if plan.size is not None and resume > plan.size:
                    partial.unlink()
                    resume = 0
                try:
                    with open(partial, "ab") as raw:
                        out = _HashingFile(raw, partial, checksum)
                        http_get(
                            plan.location,
                            out,  # type: ignore[arg-type]
                            resume_size=resume,
                            headers=headers,
                            expected_size=plan.size,
                            displayed_filename=plan.name,
                            tqdm_class=_bar_class(on_progress),  # type: ignore[arg-type]
                        )
                        digest = out.hexdigest()
                except Exception as exc:  # noqa: BLE001
                    have = partial.stat().st_size if partial.is_file() else 0
                    if plan.size is not None and have > plan.size:
                        partial.unlink(missing_ok=True)
                        have = 0
                    if type(exc) is OSError and "Consistency check failed" in str(exc):
                        # http_get's size check: the server sent fewer (or more) bytes than announced.
                        err: LlmctlError = HubError(
                            f"the download of {plan.name} from {hub_endpoint()} ended at {_fmt_size(have)} "
                            f"instead of {_fmt_size(plan.size or 0)}"
                        )
                    else:
                        err = self._translate(exc, plan.name)
                    if have:
                        raise HubError(
                            f"{err} — {_fmt_size(have)} of {plan.name} are kept; "
                            f"run `llmctl pull {self.ref}` again to resume"
                        ) from exc
                    raise err from exc
                if checksum is None or digest == checksum.value:
                    os.chmod(partial, 0o644)
                    os.replace(partial, blob)
                    return
                partial.unlink(missing_ok=True)
                if resume == 0 or attempt == 1:
                    raise _corrupted(self.repo_id, self.revision, plan.name, checksum, digest or "", self.ref)
                # The bytes kept from an earlier run did not add up: fetch the whole file once more.
                if on_progress is not None:
                    on_progress(0)


def _check_disk_space(storage: Path, needed: int, what: str) -> None:
    probe = storage
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return
    if needed > free:
        raise HubError(
            f"not enough disk space for {what}: {_fmt_size(needed)} to download, {_fmt_size(free)} free in {probe} "
            "(free some space, `llmctl rm` unused models, or point HF_HUB_CACHE elsewhere)"
        )


def _use_xet(meta: Any) -> bool:
    if getattr(meta, "xet_file_data", None) is None:
        return False
    try:
        from huggingface_hub.utils import is_xet_available

        return bool(is_xet_available())
    except ImportError:  # pragma: no cover
        return False


def _host(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return (parts.scheme, (parts.hostname or "").lower(), parts.port)


def _write_ref(storage: Path, revision: str, commit: str) -> None:
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


def _weight_map_files(index_path: Path) -> list[str]:
    try:
        data = json.loads(index_path.read_text())
        weight_map = data["weight_map"]
        return sorted(set(str(v) for v in weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise HubError(f"{index_path} is not a valid safetensors index: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Cache lookups
# --------------------------------------------------------------------------------------------


def _snapshot_weight_files(snapshot: Path) -> list[Path] | None:
    """The safetensors files of a snapshot (None if the index names a missing shard)."""
    index = snapshot / _INDEX_FILE
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


def _snapshot_is_complete(snapshot: Path) -> bool:
    """A snapshot llmctl can load: config.json and all its safetensors weights are present."""
    if not (snapshot / "config.json").is_file():
        return False
    weights = _snapshot_weight_files(snapshot)
    return bool(weights)


def find_cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The cached snapshot directory of ``repo_id`` at ``revision``, if it is complete; no network.

    ``revision`` may be a branch or tag (looked up in ``refs/``), a full commit hash or a commit
    prefix of 7+ hex digits. With ``revision=None``, ``refs/main`` is used, else the most
    recently modified complete snapshot.
    """
    storage = _storage(repo_id)
    snapshots = storage / "snapshots"
    if not snapshots.is_dir():
        return None

    def complete(commit: str) -> Path | None:
        path = snapshots / commit
        return path if path.is_dir() and _snapshot_is_complete(path) else None

    def read_ref(name: str) -> str | None:
        ref = storage / "refs" / name
        try:
            return ref.read_text().strip() if ref.is_file() else None
        except OSError:
            return None

    if revision is None:
        commit = read_ref(DEFAULT_REVISION)
        if commit and (found := complete(commit)):
            return found
        candidates = [p for p in snapshots.iterdir() if p.is_dir() and _snapshot_is_complete(p)]
        return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None
    if _FULL_COMMIT.match(revision):
        return complete(revision)
    commit = read_ref(revision)
    if commit:
        return complete(commit)
    if _COMMIT_PREFIX.match(revision):
        matches = [p for p in snapshots.iterdir() if p.name.startswith(revision) and p.is_dir()]
        if len(matches) == 1:
            return complete(matches[0].name)
    return None


# --------------------------------------------------------------------------------------------
# ls
# --------------------------------------------------------------------------------------------


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
    weights = _snapshot_weight_files(snapshot)
    if weights:
        try:
            num_parameters, dtype = safetensors_stats(weights)
        except (OSError, ValueError, TypeError):
            num_parameters, dtype = None, None
    if dtype is None and isinstance(config_dtype, str):
        dtype = config_dtype
    return architecture, num_parameters, dtype, _snapshot_is_complete(snapshot)


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


def _partial_downloads() -> dict[str, int]:
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


# --------------------------------------------------------------------------------------------
# rm
# --------------------------------------------------------------------------------------------


def remove(ref: str) -> int:
    """Delete ``ORG/NAME`` (every cached revision, partial downloads included) or ``ORG/NAME@REV``
    (that revision only; blobs still used by another revision are kept). Returns the bytes freed."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    repo_id, revision = parse_model_ref(ref)
    cache = hub_cache_dir()
    storage = _storage(repo_id, cache)
    if not storage.is_dir():
        raise ModelNotFoundError(f"{repo_id} is not in the Hugging Face cache {cache} (`llmctl ls` lists cached models)")
    try:
        info = scan_cache_dir(cache)
    except CacheNotFound as exc:  # pragma: no cover - storage exists, so the cache does
        raise ModelNotFoundError(f"{repo_id} is not in the Hugging Face cache {cache}") from exc
    repo = next((r for r in info.repos if r.repo_type == "model" and r.repo_id == repo_id), None)

    if revision is None:
        partial = sum(p.stat().st_size for p in (storage / "blobs").glob("*.incomplete") if p.is_file())
        if repo is not None and repo.revisions:
            strategy = info.delete_revisions(*(r.commit_hash for r in repo.revisions))
            freed = strategy.expected_freed_size + partial
            strategy.execute()
        else:  # only partial downloads, or a repo folder scan_cache_dir cannot parse
            freed = _regular_files_size(storage)
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(cache / ".locks" / _repo_folder(repo_id), ignore_errors=True)
        return freed

    revisions = list(repo.revisions) if repo is not None else []
    matches = [
        r
        for r in revisions
        if revision in r.refs or r.commit_hash == revision or (_COMMIT_PREFIX.match(revision) and r.commit_hash.startswith(revision))
    ]
    if len(matches) != 1:
        cached = ", ".join(
            f"{', '.join(sorted(r.refs)) or 'detached'} ({r.commit_hash[:12]})" for r in sorted(revisions, key=lambda r: r.commit_hash)
        )
        why = "is ambiguous" if matches else "is not in the cache"
        raise ModelNotFoundError(
            f"revision {revision!r} of {repo_id} {why} (cached: {cached or 'none'}); `llmctl rm {repo_id}` removes all"
        )
    strategy = info.delete_revisions(matches[0].commit_hash)
    freed = strategy.expected_freed_size
    strategy.execute()
    return freed


def _regular_files_size(root: Path) -> int:
    total = 0
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                with contextlib.suppress(OSError):
                    total += path.stat().st_size
    return total


# --------------------------------------------------------------------------------------------
# MODEL arguments: local directory, cached hub id, or pull
# --------------------------------------------------------------------------------------------


def resolve_model_dir(spec: str, *, allow_pull: bool | None = None, console: "Console | None" = None) -> Path:
    """Turn a MODEL argument into a directory holding config.json and safetensors weights.

    - a local directory with config.json -> that directory;
    - ``ORG/NAME[@REV]`` in the HF cache -> its snapshot (no network);
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

    repo_id, revision = parse_model_ref(text)
    if not _REPO_ID.match(repo_id) or "--" in repo_id or ".." in repo_id:
        raise ModelNotFoundError(
            f"{spec!r} is neither a model directory (with config.json) nor a hub id ORG/NAME[@REVISION]"
        )
    cached = find_cached_snapshot(repo_id, revision)
    if cached is not None:
        return cached

    where = f"{repo_id}@{revision}" if revision else repo_id
    if allow_pull is None:
        if sys.stdin is not None and sys.stdin.isatty():
            from rich.prompt import Confirm

            if Confirm.ask(
                f"{where} is not in the Hugging Face cache. Download it from {hub_endpoint()}?",
                default=True,
                console=console,
            ):
                allow_pull = True
            else:
                raise ModelNotFoundError(f"{where} is not downloaded (declined); `llmctl pull {text}` fetches it")
        else:
            allow_pull = False
    if allow_pull:
        return pull(text, console=console)
    raise ModelNotFoundError(
        f"model {text!r} is not a local directory and not in the Hugging Face cache ({hub_cache_dir()}); "
        f"run `llmctl pull {text}` first"
    )


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _fmt_size(n: int) -> str:
    from rich.filesize import decimal

    return decimal(n)


def _fmt_params(n: int | None) -> str:
    if n is None:
        return "?"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


@contextlib.contextmanager
def _cli_errors() -> Iterator[None]:
    import typer
    from rich.console import Console

    try:
        yield
    except LlmctlError as exc:
        message = " ".join(str(exc).split())
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        Console(stderr=True, soft_wrap=True).print(
            "[yellow]interrupted[/yellow]: partial downloads are kept; run the same command again to resume",
            highlight=False,
        )
        raise typer.Exit(130) from None


def register_hub_commands(app: "typer.Typer") -> None:
    """Add ``pull``, ``ls`` and ``rm`` to a typer app."""
    import typer
    from rich.console import Console
    from rich.table import Table

    @app.command("pull")
    def pull_command(
        model: str = typer.Argument(..., metavar="REPO_ID[@REVISION]", help="Hugging Face model id, e.g. org/name@main."),
        token: str | None = typer.Option(
            None, "--token", help="Hugging Face token for gated/private repos (default: HF_TOKEN).", show_default=False
        ),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
    ) -> None:
        """Download a model into the Hugging Face cache. Config, tokenizer and safetensors weights."""
        with _cli_errors():
            path = pull(model, token=token, console=Console(stderr=True), progress=not quiet)
        Console(soft_wrap=True).print(f"[green]✓[/green] {escape(model)} → {escape(str(path))}", highlight=False)

    @app.command("ls")
    def ls_command() -> None:
        """List the models in the Hugging Face cache."""
        with _cli_errors():
            models = list_models()
            partial = _partial_downloads()
        out = Console()
        if not models and not partial:
            out.print(
                f"No models in the Hugging Face cache ({escape(str(hub_cache_dir()))}). "
                "Download one with `llmctl pull ORG/NAME`.",
                highlight=False,
            )
            return
        if models:
            table = Table(box=None, pad_edge=False, header_style="bold")
            for column, justify in (
                ("NAME", "left"),
                ("REVISION", "left"),
                ("SIZE", "right"),
                ("ARCHITECTURE", "left"),
                ("PARAMS", "right"),
                ("DTYPE", "left"),
            ):
                table.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
            for m in models:
                revision = m.revision if m.complete else f"{m.revision} (incomplete)"
                table.add_row(
                    escape(m.repo_id),
                    escape(revision),
                    _fmt_size(m.size_on_disk),
                    escape(m.architecture or "?"),
                    _fmt_params(m.num_parameters),
                    escape(m.dtype or "?"),
                )
            out.print(table)
        for repo_id, size in sorted(partial.items()):
            out.print(
                f"partial download: {escape(repo_id)} ({_fmt_size(size)}) — `llmctl pull {escape(repo_id)}` resumes it, "
                f"`llmctl rm {escape(repo_id)}` deletes it",
                highlight=False,
            )

    @app.command("rm")
    def rm_command(
        model: str = typer.Argument(..., metavar="REPO_ID[@REVISION]", help="Cached model (all revisions unless @REVISION)."),
    ) -> None:
        """Delete a cached model, or one revision of it."""
        with _cli_errors():
            freed = remove(model)
        Console(soft_wrap=True).print(f"Removed {escape(model)} ({_fmt_size(freed)} freed)", highlight=False)
