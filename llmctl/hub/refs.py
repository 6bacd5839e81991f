"""Model references: ``ORG/NAME[@REVISION]`` parsed, checked, and found in the cache (no network)."""

from __future__ import annotations

from pathlib import Path

from llmctl.errors import ModelNotFoundError
from llmctl.hub.layout import (
    COMMIT_PREFIX,
    DEFAULT_REVISION,
    FULL_COMMIT,
    REPO_ID,
    repo_storage,
    select_gguf_file,
    snapshot_gguf_files,
    snapshot_is_complete,
)


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


def split_gguf_tag(ref: str) -> tuple[str, str | None]:
    """``"org/name:Q4_K_M"`` (or ``org/name@rev:Q4_K_M``) -> ``("org/name", "Q4_K_M")``: the tag
    that picks one GGUF file of a repo, as llama.cpp and Ollama write it. A colon can be in
    neither a repo id nor a git revision, so the last one after the last '/' starts the tag."""
    head, slash, last = ref.strip().rpartition("/")
    name, colon, tag = last.partition(":")
    if not colon:
        return ref, None
    if not tag.strip():
        raise ModelNotFoundError(f"empty tag after ':' in {ref!r}: expected ORG/NAME:TAG (e.g. :Q4_K_M)")
    return head + slash + name, tag.strip()


def check_repo_id(repo_id: str, ref: str) -> None:
    if not REPO_ID.match(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        raise ModelNotFoundError(
            f"{ref!r} is not a Hugging Face repo id: expected ORG/NAME[@REVISION] with letters, digits, '-', '_' or '.'"
        )


def find_cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The cached snapshot directory of ``repo_id`` at ``revision``, if it is complete; no network.

    ``revision`` may be a branch or tag (looked up in ``refs/``), a full commit hash or a commit
    prefix of 7+ hex digits. With ``revision=None``, ``refs/main`` is used, else the most
    recently modified complete snapshot.
    """
    storage = repo_storage(repo_id)
    snapshots = storage / "snapshots"
    if not snapshots.is_dir():
        return None

    def complete(commit: str) -> Path | None:
        path = snapshots / commit
        return path if path.is_dir() and snapshot_is_complete(path) else None

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
        candidates = [p for p in snapshots.iterdir() if p.is_dir() and snapshot_is_complete(p)]
        return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None
    if FULL_COMMIT.match(revision):
        return complete(revision)
    commit = read_ref(revision)
    if commit:
        return complete(commit)
    if COMMIT_PREFIX.match(revision):
        matches = [p for p in snapshots.iterdir() if p.name.startswith(revision) and p.is_dir()]
        if len(matches) == 1:
            return complete(matches[0].name)
    return None


def find_cached_model(
    repo_id: str, revision: str | None = None, tag: str | None = None, include: str | None = None
) -> Path | None:
    """Like ``find_cached_snapshot``; with a GGUF ``tag`` or ``include`` glob, the cached GGUF file
    they name (None when that file is not in the snapshot)."""
    snapshot = find_cached_snapshot(repo_id, revision)
    if snapshot is None or (tag is None and include is None):
        return snapshot
    try:
        name = select_gguf_file([p.name for p in snapshot_gguf_files(snapshot)], tag, include, repo_id)
    except ValueError:
        return None
    return snapshot / name


def has_incomplete_snapshot(repo_id: str) -> bool:
    """Whether the cache holds a snapshot of ``repo_id`` that llmctl cannot load (yet)."""
    snapshots = repo_storage(repo_id) / "snapshots"
    return snapshots.is_dir() and any(p.is_dir() and not snapshot_is_complete(p) for p in snapshots.iterdir())
