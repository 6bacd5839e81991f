"""Checksums: every downloaded file is hashed while it is written and compared with what the hub
lists (sha256 for LFS files, the git blob sha1 otherwise). huggingface_hub 2.4 checks only sizes."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.errors import HubError

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Checksum:
    kind: str  # "sha256" (LFS files) or "git-sha1" (git blob id of regular files)
    value: str
    size: int | None

    def new(self) -> hashlib._Hash:
        if self.kind == "sha256":
            return hashlib.sha256()
        h = hashlib.sha1()
        h.update(b"blob %d\0" % (self.size or 0))
        return h


def expected_checksum(sibling: Any, etag: str, size: int | None) -> Checksum | None:
    """What the hub says the file must hash to: LFS sha256, else the git blob id."""
    lfs = getattr(sibling, "lfs", None)
    if lfs is not None and getattr(lfs, "sha256", None):
        return Checksum("sha256", str(lfs.sha256).lower(), getattr(lfs, "size", None) or size)
    blob_id = getattr(sibling, "blob_id", None)
    if blob_id and size is not None and re.fullmatch(r"[0-9a-f]{40}", str(blob_id)):
        return Checksum("git-sha1", str(blob_id), size)
    if _SHA256.match(etag):  # the hub names LFS blobs by their sha256
        return Checksum("sha256", etag, size)
    return None


class HashingFile:
    """A binary file wrapper that hashes what ``http_get`` writes (resumed bytes are hashed first)."""

    def __init__(self, raw: Any, path: Path, checksum: Checksum | None) -> None:
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


def hash_file(path: Path, checksum: Checksum) -> str:
    h = checksum.new()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def corrupted(repo_id: str, revision: str, filename: str, checksum: Checksum, got: str, ref: str) -> HubError:
    return HubError(
        f"checksum mismatch for {filename} of {repo_id}@{revision}: expected {checksum.kind} "
        f"{checksum.value[:16]}…, got {got[:16]}…; the corrupted download was deleted, "
        f"run `llmctl pull {ref}` to fetch it again"
    )
