"""A Hugging Face hub-compatible HTTP server for tests (stdlib ``http.server`` in a thread).

It serves model repos from directories (read in place, never copied) and in-memory files,
and speaks the subset of the hub protocol ``huggingface_hub`` 2.x uses to download:

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}`` (``?blobs=true`` adds
  size, git blob id and LFS sha256 per file): ``HfApi.model_info`` / ``repo_info``;
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: ``HfApi.list_repo_tree`` (used by ``snapshot_download``);
- ``HEAD`` and ``GET /{repo}/resolve/{rev}/{path}`` with ``X-Repo-Commit``, ``ETag`` (git blob id,
  or sha256 for LFS files, which also get ``X-Linked-Etag`` / ``X-Linked-Size``), ``Content-Length``
  and ``Range`` requests (206 + ``Content-Range``). No Xet headers are sent, so clients use plain HTTP;
- the hub's errors: 404 + ``X-Error-Code: RepoNotFound`` / ``RevisionNotFound`` / ``EntryNotFound``,
  401 + ``X-Error-Code: GatedRepo`` for a gated repo without the right ``Authorization: Bearer`` token.

Fault switches, per file: drop the connection once after N bytes (``drop_connection_once``), drop it
and then answer 503 until repaired (``break_download``, an interrupted run), serve corrupted bytes
of the announced length and checksum (``corrupt``). Every request is logged (``requests``).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".onnx", ".model", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


@dataclass
class HubFile:
    path: str
    size: int
    sha256: str
    git_oid: str
    lfs: bool
    source: Path | None = None  # read in place at request time
    data: bytes | None = None

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        assert self.source is not None
        return self.source.read_bytes()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid


@dataclass
class HubRevision:
    name: str
    commit: str
    files: dict[str, HubFile]


@dataclass
class HubRepo:
    repo_id: str
    revisions: dict[str, HubRevision] = field(default_factory=dict)  # branch/tag name -> revision
    gated_token: str | None = None

    def find(self, rev: str) -> HubRevision | None:
        if rev in self.revisions:
            return self.revisions[rev]
        for revision in self.revisions.values():
            if revision.commit == rev or (len(rev) >= 7 and revision.commit.startswith(rev)):
                return revision
        return None


@dataclass
class LoggedRequest:
    method: str
    path: str
    range: str | None
    authorization: str | None


_DIGESTS: dict[tuple[str, int, int], tuple[int, str, str]] = {}  # (source, mtime_ns, size) -> digests


def _digests(content: bytes) -> tuple[int, str, str]:
    git = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
    return len(content), hashlib.sha256(content).hexdigest(), git


def _hub_file(path: str, *, source: Path | None = None, data: bytes | None = None) -> HubFile:
    if source is not None:
        stat = source.stat()
        key = (str(source), stat.st_mtime_ns, stat.st_size)
        if key not in _DIGESTS:
            _DIGESTS[key] = _digests(source.read_bytes())
        size, sha256, git = _DIGESTS[key]
    else:
        assert data is not None
        size, sha256, git = _digests(data)
    return HubFile(
        path=path,
        size=size,
        sha256=sha256,
        git_oid=git,
        lfs=path.endswith(LFS_SUFFIXES),
        source=source,
        data=data if source is None else None,
    )


class HubServer:
    """``with HubServer() as hub: hub.add_repo(...); os.environ["HF_ENDPOINT"] = hub.url``."""

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.log: list[LoggedRequest] = []
        self._drop_once: dict[tuple[str, str], int] = {}
        self._broken: dict[tuple[str, str], int | None] = {}  # None: already dropped once -> 503
        self._corrupt: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- content -------------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        source: Path | None = None,
        *,
        revision: str = "main",
        extra: dict[str, bytes] | None = None,
        gated_token: str | None = None,
    ) -> str:
        """Serve the files of ``source`` (recursively, read in place) plus ``extra`` at ``revision``;
        return its commit."""
        files: dict[str, HubFile] = {}
        if source is not None:
            for path in sorted(source.rglob("*")):
                if path.is_file():
                    rel = path.relative_to(source).as_posix()
                    files[rel] = _hub_file(rel, source=path)
        for rel, data in (extra or {}).items():
            files[rel] = _hub_file(rel, data=data)
        seed = f"{repo_id}\0{revision}\0" + "".join(f"{p}:{f.sha256}" for p, f in sorted(files.items()))
        commit = hashlib.sha1(seed.encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, HubRepo(repo_id))
        if gated_token is not None:
            repo.gated_token = gated_token
        repo.revisions[revision] = HubRevision(revision, commit, files)
        return commit

    # ---- fault switches ------------------------------------------------------------------

    def drop_connection_once(self, repo_id: str, path: str, *, at: int) -> None:
        """The next GET of this file closes the connection after byte ``at`` (absolute offset)."""
        self._drop_once[(repo_id, path)] = at

    def break_download(self, repo_id: str, path: str, *, at: int) -> None:
        """Drop the connection after byte ``at``, then answer 503 to every GET until ``repair``."""
        self._broken[(repo_id, path)] = at

    def repair(self, repo_id: str, path: str) -> None:
        self._broken.pop((repo_id, path), None)
        self._drop_once.pop((repo_id, path), None)
        self._corrupt.discard((repo_id, path))

    def corrupt(self, repo_id: str, path: str, enabled: bool = True) -> None:
        """Serve this file with some bytes flipped (same length; headers keep the true checksum)."""
        if enabled:
            self._corrupt.add((repo_id, path))
        else:
            self._corrupt.discard((repo_id, path))

    # ---- request log ---------------------------------------------------------------------

    def requests(self, method: str | None = None, contains: str | None = None) -> list[LoggedRequest]:
        with self._lock:
            return [
                r
                for r in self.log
                if (method is None or r.method == method) and (contains is None or contains in unquote(r.path))
            ]

    def clear_log(self) -> None:
        with self._lock:
            self.log.clear()

    # ---- lifecycle -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        handler = type("BoundHubHandler", (_HubHandler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        httpd = self._httpd
        self._thread = threading.Thread(
            target=lambda: httpd.serve_forever(poll_interval=0.05), name="hub-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def closed_port_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: HubServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
        pass

    def do_HEAD(self) -> None:  # noqa: N802
        self._handle(head=True)

    def do_GET(self) -> None:  # noqa: N802
        self._handle(head=False)

    # ---- plumbing ------------------------------------------------------------------------

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _json(self, payload: object, head: bool) -> None:
        self._send(200, json.dumps(payload).encode(), {"Content-Type": "application/json"}, head)

    def _error(
        self, status: int, code: str | None, message: str, head: bool, extra: dict[str, str] | None = None
    ) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        headers.update(extra or {})
        self._send(status, json.dumps({"error": message}).encode(), headers, head)

    def _handle(self, head: bool) -> None:
        url = urlsplit(self.path)
        with self.hub._lock:
            self.hub.log.append(
                LoggedRequest(self.command, url.path, self.headers.get("Range"), self.headers.get("Authorization"))
            )
        if url.path.startswith("/api/models/"):
            self._api(url.path[len("/api/models/") :], parse_qs(url.query), head)
        elif "/resolve/" in url.path:
            self._resolve(url.path, head)
        else:
            self._error(404, None, "Not Found", head)

    def _repo(self, repo_id: str, head: bool) -> HubRepo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found", head)
        return repo

    def _revision(self, repo: HubRepo, rev: str, head: bool) -> HubRevision | None:
        revision = repo.find(rev)
        if revision is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        return revision

    def _authorized(self, repo: HubRepo) -> bool:
        return repo.gated_token is None or self.headers.get("Authorization") == f"Bearer {repo.gated_token}"

    # ---- /api/models ---------------------------------------------------------------------

    def _api(self, rest: str, query: dict[str, list[str]], head: bool) -> None:
        tree_path = ""
        if "/revision/" in rest:
            repo_part, rev_part = rest.split("/revision/", 1)
            kind = "info"
        elif "/tree/" in rest:
            repo_part, tail = rest.split("/tree/", 1)
            rev_part, _, tree_path = tail.partition("/")
            kind = "tree"
        else:
            repo_part, rev_part, kind = rest, "main", "info"
        repo = self._repo(unquote(repo_part).strip("/"), head)
        if repo is None:
            return
        revision = self._revision(repo, unquote(rev_part), head)
        if revision is None:
            return
        if kind == "tree":
            self._json(self._tree(revision, unquote(tree_path), query), head)
            return
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for f in revision.files.values():
            entry: dict[str, object] = {"rfilename": f.path}
            if blobs:
                entry.update({"size": f.size, "blobId": f.git_oid})
                if f.lfs:
                    entry["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
            siblings.append(entry)
        config = {}
        if "config.json" in revision.files:
            try:
                raw = json.loads(revision.files["config.json"].read())
                config = {k: raw[k] for k in ("architectures", "model_type") if k in raw}
            except ValueError:
                pass
        self._json(
            {
                "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24],
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "author": repo.repo_id.split("/")[0] if "/" in repo.repo_id else None,
                "sha": revision.commit,
                "lastModified": "2024-01-01T00:00:00.000Z",
                "private": False,
                "disabled": False,
                "gated": "manual" if repo.gated_token else False,
                "tags": ["transformers", "safetensors"],
                "downloads": 0,
                "likes": 0,
                "library_name": "transformers",
                "config": config,
                "siblings": siblings,
            },
            head,
        )

    def _tree(self, revision: HubRevision, prefix: str, query: dict[str, list[str]]) -> list[dict[str, object]]:
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = prefix.strip("/")
        base = f"{prefix}/" if prefix else ""
        entries: list[dict[str, object]] = []
        folders: set[str] = set()
        for f in revision.files.values():
            if not f.path.startswith(base):
                continue
            rest = f.path[len(base) :]
            parts = rest.split("/")
            for depth in range(1, len(parts)):
                folder = base + "/".join(parts[:depth])
                if (recursive or depth == 1) and folder not in folders:
                    folders.add(folder)
                    entries.append(
                        {
                            "type": "directory",
                            "oid": hashlib.sha1(folder.encode()).hexdigest(),
                            "size": 0,
                            "path": folder,
                        }
                    )
            if len(parts) > 1 and not recursive:
                continue
            entry: dict[str, object] = {"type": "file", "oid": f.git_oid, "size": f.size, "path": f.path}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
            entries.append(entry)
        return entries

    # ---- /{repo}/resolve/{rev}/{path} ----------------------------------------------------

    def _resolve(self, raw_path: str, head: bool) -> None:
        repo_part, after = raw_path.lstrip("/").split("/resolve/", 1)
        rev_part, _, file_part = after.partition("/")
        repo = self._repo(unquote(repo_part), head)
        if repo is None:
            return
        if not self._authorized(repo):
            self._error(401, "GatedRepo", f"Access to model {repo.repo_id} is restricted.", head)
            return
        revision = self._revision(repo, unquote(rev_part), head)
        if revision is None:
            return
        name = unquote(file_part)
        f = revision.files.get(name)
        if f is None:
            self._error(404, "EntryNotFound", "Entry not found", head, {"X-Repo-Commit": revision.commit})
            return
        headers = {
            "X-Repo-Commit": revision.commit,
            "ETag": f'"{f.etag}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if f.lfs:
            headers["X-Linked-Etag"] = f'"{f.sha256}"'
            headers["X-Linked-Size"] = str(f.size)
        if head:
            self.send_response(200)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(f.size))
            self.end_headers()
            return
        self._serve_bytes(repo.repo_id, f, headers)

    def _serve_bytes(self, repo_id: str, f: HubFile, headers: dict[str, str]) -> None:
        key = (repo_id, f.path)
        if key in self.hub._broken and self.hub._broken[key] is None:
            self._error(503, None, "Service temporarily unavailable", False)
            return
        data = f.read()
        if key in self.hub._corrupt:
            mutable = bytearray(data)
            for i in range(len(mutable) // 2, min(len(mutable), len(mutable) // 2 + 16)):
                mutable[i] ^= 0xFF
            data = bytes(mutable)
        start, end = 0, f.size - 1
        status = 200
        range_header = self.headers.get("Range")
        if range_header:
            spec = range_header.strip().removeprefix("bytes=")
            first, _, last = spec.partition("-")
            start = int(first) if first else 0
            end = int(last) if last else f.size - 1
            if start >= f.size or end < start:
                self._error(416, None, "Range Not Satisfiable", False, {"Content-Range": f"bytes */{f.size}"})
                return
            end = min(end, f.size - 1)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{f.size}"
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()

        drop_at: int | None = None
        if key in self.hub._drop_once:
            drop_at = self.hub._drop_once.pop(key)
        elif key in self.hub._broken:
            drop_at = self.hub._broken[key]
            self.hub._broken[key] = None  # from now on: 503
        stop = end + 1 if drop_at is None else max(start, min(end + 1, drop_at))
        position = start
        try:
            while position < stop:
                chunk = data[position : min(stop, position + (1 << 20))]
                self.wfile.write(chunk)
                position += len(chunk)
            self.wfile.flush()
            if drop_at is not None:
                # Close mid-body: the client sees EOF before Content-Length bytes.
                self.connection.shutdown(socket.SHUT_WR)
                self.close_connection = True
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
