"""``llmctl pull``: download what inference needs of a repo into the HF cache, resumably and verified.

1. ``HfApi.model_info(files_metadata=True)`` resolves the revision to a commit and lists the
   files with their git blob id and LFS sha256.
2. Only the files inference needs are selected (``layout.select_inference_files``).
3. Each missing file is HEAD-ed (``get_hf_file_metadata``: ETag, size, download location) and
   streamed with huggingface_hub's own ``http_get`` into ``blobs/<etag>.incomplete``, a stable
   name, so an interrupted pull resumes with an HTTP ``Range`` request, both within a run
   (``http_get`` retries a dropped connection itself) and across runs. ``snapshot_download``
   with ``allow_patterns`` would select the same files, but huggingface_hub 2.4 deletes its own,
   per-process ``.incomplete`` files when a download fails (no resume across runs) and never
   checks a checksum, so llmctl drives the per-file steps itself.
4. The bytes are hashed while they are written (``checksums``); a mismatch deletes the file and
   raises ``HubError``; nothing unverified is moved into ``blobs/``.
5. The verified blob is linked into ``snapshots/<commit>/`` by ``hf_hub_download`` (which finds
   the blob in place and only creates the symlink), ``config.json`` last, and ``refs/<revision>``
   is written once every file is in place. Files stored with Xet are fetched by
   ``hf_hub_download`` itself and verified after.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from rich.markup import escape

from llmctl.errors import HubError, LlmctlError
from llmctl.hub.checksums import HashingFile, corrupted, expected_checksum, hash_file
from llmctl.hub.errors import is_unreachable, translate_error
from llmctl.hub.layout import (
    DEFAULT_REVISION,
    FULL_COMMIT,
    INDEX_FILE,
    gguf_files,
    hub_cache_dir,
    hub_endpoint,
    offline,
    repo_folder,
    repo_storage,
    select_gguf_file,
    select_inference_files,
    snapshot_is_complete,
    user_agent,
    write_ref,
)
from llmctl.hub.progress import PullProgress, bar_class, fmt_size
from llmctl.hub.refs import check_repo_id, find_cached_model, parse_model_ref, split_gguf_tag

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console


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
    console: Console | None = None,
    progress: bool = True,
    include: str | None = None,
) -> Path:
    """Download what inference needs of ``ORG/NAME[@REVISION][:TAG]`` into the HF cache; return the
    snapshot dir, or for a GGUF pull the one ``.gguf`` file fetched into it.

    GGUF: ``:TAG`` (e.g. ``:Q4_K_M``, as llama.cpp and Ollama write it) or ``include`` (a glob such
    as ``*Q4_K_M.gguf``) picks one ``.gguf`` file; a repo without config.json gets its only GGUF
    file, else its ``Q4_K_M`` one. The file is downloaded, resumed and verified like safetensors.

    Already-cached files are not downloaded again; a partial file from an interrupted pull is
    resumed with a Range request; every downloaded file is checked against the hub's checksum.
    ``token`` defaults to ``HF_TOKEN`` (or the token saved by ``hf auth login``).
    Raises ``HubError`` (unreachable endpoint, missing repo or revision, gated repo, checksum
    mismatch) or ``ModelNotFoundError`` (malformed id).
    """
    from rich.console import Console

    untagged, tag = split_gguf_tag(ref)
    repo_id, revision = parse_model_ref(untagged)
    check_repo_id(repo_id, ref)
    rev = revision or DEFAULT_REVISION
    console = console or Console(stderr=True)
    token = token or None
    endpoint = hub_endpoint()

    if revision is not None and FULL_COMMIT.match(revision):
        cached = find_cached_model(repo_id, revision, tag, include)
        if cached is not None:  # a commit never changes: nothing to ask the hub
            if progress:
                console.print(
                    f"{repo_id}@{revision[:12]} is already in the cache: {escape(str(cached))}", highlight=False
                )
            return cached

    if offline():
        cached = find_cached_model(repo_id, revision, tag, include)
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
        info = HfApi(endpoint=endpoint, token=token, **user_agent()).model_info(
            repo_id, revision=rev, files_metadata=True
        )
    except Exception as exc:  # noqa: BLE001 - translated below
        if is_unreachable(exc):
            cached = find_cached_model(repo_id, revision, tag, include)
            if cached is not None:
                reason = translate_error(exc, repo_id=repo_id, revision=revision, token=token)
                console.print(
                    f"[yellow]warning:[/yellow] {escape(str(reason))}; using the cached snapshot {escape(str(cached))}",
                    highlight=False,
                    soft_wrap=True,
                )
                return cached
        raise translate_error(exc, repo_id=repo_id, revision=revision, token=token) from exc

    commit = getattr(info, "sha", None)
    if not commit:
        raise HubError(f"{endpoint} did not report a commit for {repo_id}@{rev}; is HF_ENDPOINT a Hugging Face hub?")
    siblings = {s.rfilename: s for s in (info.siblings or [])}
    cache = hub_cache_dir()
    storage = repo_storage(repo_id, cache)
    snapshot = storage / "snapshots" / commit

    ctx = _PullContext(repo_id=repo_id, revision=rev, commit=commit, ref=ref, token=token, cache=cache)
    transformers_format = "config.json" in siblings and any(f.endswith(".safetensors") for f in siblings)
    gguf_pull = tag is not None or include is not None or (not transformers_format and bool(gguf_files(list(siblings))))
    if gguf_pull:
        try:
            wanted = [select_gguf_file(list(siblings), tag, include, f"{repo_id}@{rev}")]
        except ValueError as exc:
            raise HubError(str(exc)) from None
    else:
        wanted = _safetensors_files(ctx, siblings, snapshot, console)

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
        parts = [f"{len(to_download)} file(s) to download ({fmt_size(total)})"]
        if resumed:
            parts.append(f"resuming {fmt_size(resumed)} already downloaded")
        if cached_count:
            parts.append(f"{cached_count} already cached")
        console.print(
            f"Pulling [bold]{repo_id}[/bold]@{escape(rev)} (commit {commit[:12]}) from {escape(endpoint)}: "
            + ", ".join(parts),
            highlight=False,
            soft_wrap=True,
        )

    _check_disk_space(storage, total - resumed, f"{repo_id}@{rev}")
    title = f"{repo_id}@{rev}"
    with PullProgress(console, progress and bool(to_download), title, total) as bars:
        for plan in plans:
            ctx.fetch(plan, bars)

    if not snapshot_is_complete(snapshot) or not all((snapshot / name).is_file() for name in wanted):
        raise HubError(f"{repo_id}@{rev} was downloaded but {snapshot} is incomplete (config.json or weights missing)")
    write_ref(storage, rev, commit)
    return snapshot / wanted[0] if gguf_pull else snapshot


def _safetensors_files(ctx: _PullContext, siblings: dict[str, Any], snapshot: Path, console: Console) -> list[str]:
    """What a transformers-format repo needs: config, tokenizer, safetensors (the index read first)."""
    repo_id, rev = ctx.repo_id, ctx.revision
    if "config.json" not in siblings:
        raise HubError(
            f"{repo_id}@{rev} has no config.json at its top level; "
            "it is not a transformers-format model llmctl can load"
        )
    # Sharded weights: the index names the shards to fetch (and nothing else, e.g. no consolidated.safetensors).
    weight_map_files: list[str] | None = None
    if INDEX_FILE in siblings:
        index_plan = ctx.plan(INDEX_FILE, siblings[INDEX_FILE], snapshot)
        if index_plan is not None:
            with PullProgress(console, False, "", 0) as quiet:
                ctx.fetch(index_plan, quiet)
        weight_map_files = _weight_map_files(snapshot / INDEX_FILE)
        missing = [f for f in weight_map_files if f not in siblings]
        if missing:
            raise HubError(
                f"{INDEX_FILE} of {repo_id}@{rev} names shards the repo does not have: {', '.join(missing[:3])}"
            )

    wanted = select_inference_files(list(siblings), weight_map_files)
    if not any(f.endswith(".safetensors") for f in wanted):
        others = sorted(f for f in siblings if f.endswith((".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")))
        found = f" (it has {', '.join(others[:3])})" if others else ""
        raise HubError(f"{repo_id}@{rev} has no safetensors weights{found}; llmctl loads .safetensors or .gguf")

    return wanted


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
        return repo_storage(self.repo_id, self.cache)

    def _error(self, exc: BaseException, filename: str) -> LlmctlError:
        return translate_error(exc, repo_id=self.repo_id, revision=self.revision, token=self.token, filename=filename)

    def plan(self, name: str, sibling: Any, snapshot: Path) -> _FilePlan | None:
        """HEAD the file unless the snapshot already has it; None when nothing is to be done."""
        pointer = snapshot / name
        if pointer.is_file():  # exists and, if a symlink, its blob too
            return None
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        url = hf_hub_url(self.repo_id, name, revision=self.commit, endpoint=hub_endpoint())
        try:
            meta = get_hf_file_metadata(url, token=self.token, endpoint=hub_endpoint(), **user_agent())
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, name) from exc
        if not meta.etag:
            raise HubError(
                f"{hub_endpoint()} sent no ETag for {name} of {self.repo_id}; is HF_ENDPOINT a Hugging Face hub?"
            )
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

    def fetch(self, plan: _FilePlan, bars: PullProgress) -> None:
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
        return self._hf_hub_download(name, None)

    def _hf_hub_download(self, name: str, on_progress: Callable[[int], None] | None) -> Path:
        """One file through hf_hub_download into this cache at the pinned commit; errors named."""
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
                    tqdm_class=bar_class(on_progress),
                    **user_agent(),
                )
            )
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, name) from exc

    def _fetch_with_hf(self, plan: _FilePlan, on_progress: Callable[[int], None] | None, bars: PullProgress) -> None:
        """Xet-stored files: hf_hub_download drives hf_xet (chunk-level dedup and cache), then we verify."""
        pointer = self._hf_hub_download(plan.name, on_progress)
        checksum = expected_checksum(plan.sibling, plan.etag, plan.size)
        if checksum is None:
            return
        bars.describe(plan.name, f"{escape(plan.name)} (verifying {checksum.kind})")
        got = hash_file(pointer, checksum)
        if got != checksum.value:
            blob = pointer.resolve()
            pointer.unlink(missing_ok=True)
            blob.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # no empty snapshots/<commit>/ left behind
                pointer.parent.rmdir()
            raise corrupted(self.repo_id, self.revision, plan.name, checksum, got, self.ref)

    def _download_blob(self, plan: _FilePlan, on_progress: Callable[[int], None] | None) -> None:
        """Stream the file into blobs/<etag>.incomplete (resuming it), verify, move it to blobs/<etag>."""
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import WeakFileLock, build_hf_headers

        blobs = self.storage / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        blob = blobs / plan.etag
        partial = blobs / f"{plan.etag}.incomplete"
        lock = self.cache / ".locks" / repo_folder(self.repo_id) / f"{plan.etag}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        checksum = expected_checksum(plan.sibling, plan.etag, plan.size)

        headers = build_hf_headers(token=self.token, **user_agent())
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
                        out = HashingFile(raw, partial, checksum)
                        http_get(
                            plan.location,
                            out,  # type: ignore[arg-type]
                            resume_size=resume,
                            headers=headers,
                            expected_size=plan.size,
                            displayed_filename=plan.name,
                            tqdm_class=bar_class(on_progress),  # type: ignore[arg-type]
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
                            f"the download of {plan.name} from {hub_endpoint()} ended at {fmt_size(have)} "
                            f"instead of {fmt_size(plan.size or 0)}"
                        )
                    else:
                        err = self._error(exc, plan.name)
                    if have:
                        raise HubError(
                            f"{err} — {fmt_size(have)} of {plan.name} are kept; "
                            f"run `llmctl pull {self.ref}` again to resume"
                        ) from exc
                    raise err from exc
                if checksum is None or digest == checksum.value:
                    os.chmod(partial, 0o644)
                    os.replace(partial, blob)
                    return
                partial.unlink(missing_ok=True)
                if resume == 0 or attempt == 1:
                    raise corrupted(self.repo_id, self.revision, plan.name, checksum, digest or "", self.ref)
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
            f"not enough disk space for {what}: {fmt_size(needed)} to download, {fmt_size(free)} free in {probe} "
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


def _weight_map_files(index_path: Path) -> list[str]:
    try:
        data = json.loads(index_path.read_text())
        weight_map = data["weight_map"]
        return sorted(set(str(v) for v in weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise HubError(f"{index_path} is not a valid safetensors index: {exc}") from exc
