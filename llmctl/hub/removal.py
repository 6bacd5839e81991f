"""``llmctl rm``: delete a model or one revision with ``scan_cache_dir().delete_revisions`` (blobs
another revision still uses are kept), plus the partial downloads ``scan_cache_dir`` does not see."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from llmctl.errors import ModelNotFoundError
from llmctl.hub.layout import COMMIT_PREFIX, hub_cache_dir, repo_folder, repo_storage
from llmctl.hub.refs import parse_model_ref


def remove(ref: str) -> int:
    """Delete ``ORG/NAME`` (every cached revision, partial downloads included) or ``ORG/NAME@REV``
    (that revision only; blobs still used by another revision are kept). Returns the bytes freed."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    repo_id, revision = parse_model_ref(ref)
    cache = hub_cache_dir()
    storage = repo_storage(repo_id, cache)
    if not storage.is_dir():
        raise ModelNotFoundError(
            f"{repo_id} is not in the Hugging Face cache {cache} (`llmctl ls` lists cached models)"
        )
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
        shutil.rmtree(cache / ".locks" / repo_folder(repo_id), ignore_errors=True)
        return freed

    revisions = list(repo.revisions) if repo is not None else []
    matches = [
        r
        for r in revisions
        if revision in r.refs
        or r.commit_hash == revision
        or (COMMIT_PREFIX.match(revision) and r.commit_hash.startswith(revision))
    ]
    if len(matches) != 1:
        cached = ", ".join(
            f"{', '.join(sorted(r.refs)) or 'detached'} ({r.commit_hash[:12]})"
            for r in sorted(revisions, key=lambda r: r.commit_hash)
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
