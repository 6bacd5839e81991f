"""The container image's files. Docker itself does not run on the test machines, so the Dockerfile
is linted (hadolint) and read, and its entrypoint and health check are run here directly."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from deploy_helpers import REPO_ROOT

DOCKERFILE = REPO_ROOT / "Dockerfile"
ENTRYPOINT = REPO_ROOT / "deploy" / "docker" / "entrypoint.sh"
HEALTHCHECK = REPO_ROOT / "deploy" / "docker" / "healthcheck.py"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_builds_kernels_runs_unprivileged_and_checks_health():
    steps = _instructions()
    runs = " ".join(args for op, args in steps if op == "RUN")
    assert "python -m llmctl_kernels.cpu_native" in runs  # the native CPU kernels are built into the image
    assert '"torch==${TORCH_VERSION}"' in runs and "--index-url" in runs
    users = [args for op, args in steps if op == "USER"]
    assert users and users[-1] != "root" and not users[-1].startswith("0")
    assert ("VOLUME", '["/cache"]') in steps
    env = " ".join(args for op, args in steps if op == "ENV")
    assert "HF_HOME=/cache/huggingface" in env
    assert [op for op, _ in steps].count("HEALTHCHECK") == 1
    assert ("ENTRYPOINT", '["llmctl-entrypoint"]') in steps and ("CMD", '["serve"]') in steps
    args = {a.split("=")[0] for op, a in steps if op == "ARG"}
    assert {"TORCH_INDEX_URL", "PYTHON_IMAGE"} <= args  # the CUDA variant is a build argument


def test_dockerignore_lets_in_every_copied_path():
    ignore = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in ignore  # everything is left out unless let in below
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for op, args in _instructions():
        if op == "COPY":
            sources = [a for a in args.split() if not a.startswith("--")][:-1]
            for source in sources:
                assert any(source.rstrip("/") == a or source.startswith(a + "/") for a in allowed), source
                assert (REPO_ROOT / source).exists(), source


def _run_entrypoint(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """The entrypoint with a stand-in llmctl that prints the arguments it was given, one a line."""
    stub = tmp_path / "llmctl"
    stub.write_text('#!/bin/sh\nfor arg in "$@"; do echo "$arg"; done\n')
    stub.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    result = subprocess.run(
        [str(ENTRYPOINT), *args],
        env={**clean, "LLMCTL_BIN": str(stub), **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_entrypoint_turns_environment_into_serve_flags(tmp_path):
    argv = _run_entrypoint(
        tmp_path,
        "serve",
        "--seed",
        "7",
        env={
            "LLMCTL_MODEL": "Qwen/Qwen2.5-0.5B-Instruct",
            "LLMCTL_DRAIN_TIMEOUT": "60",
            "LLMCTL_THREADS": "8",
            "LLMCTL_KV_CACHE_MEMORY": "8GiB",
            "LLMCTL_SERVED_MODEL_NAME": "qwen small",
            "LLMCTL_EXTRA_ARGS": "--no-access-log",
        },
    )
    assert argv == [
        "serve",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--served-model-name",
        "qwen small",
        "--drain-timeout",
        "60",
        "--kv-cache-memory",
        "8GiB",
        "--threads",
        "8",
        "--seed",
        "7",
        "--no-access-log",
    ]
    assert _run_entrypoint(tmp_path)[:2] == ["serve", "tiny-random-llama"]  # no arguments: serve


def test_entrypoint_router_mode_and_api_key_file(tmp_path):
    key = tmp_path / "api-key"
    key.write_text("s3cret")
    stub = tmp_path / "llmctl"
    argv = _run_entrypoint(tmp_path, "router", env={"LLMCTL_PORT": "9000", "LLMCTL_ROUTER_POLICY": "round-robin"})
    assert argv == ["router", "--host", "0.0.0.0", "--port", "9000", "--policy", "round-robin"]
    stub.write_text('#!/bin/sh\necho "$LLMCTL_API_KEY"\n')
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    result = subprocess.run(
        [str(ENTRYPOINT), "router"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**clean, "LLMCTL_BIN": str(stub), "LLMCTL_API_KEY_FILE": str(key)},
    )
    assert result.stdout.strip() == "s3cret"


def test_entrypoint_pull_mode_skips_the_embedded_model(tmp_path):
    assert _run_entrypoint(tmp_path, "pull") == ["llmctl-entrypoint: nothing to pull for tiny-random-llama"]
    assert _run_entrypoint(tmp_path, "pull", env={"LLMCTL_MODEL": "org/model"}) == ["pull", "org/model", "--quiet"]


def test_entrypoint_runs_the_real_llmctl():
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO_ROOT),
    }
    if not shutil.which("llmctl", path=env["PATH"]):
        pytest.fail("llmctl is not installed next to this Python")
    result = subprocess.run([str(ENTRYPOINT), "--version"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("llmctl "), result.stderr


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the http.server interface
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def log_message(self, *args: object) -> None:
        pass


def test_healthcheck_script_exits_0_only_when_health_answers():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        ok = subprocess.run(
            [sys.executable, str(HEALTHCHECK)], env={**os.environ, "LLMCTL_PORT": str(port)}, timeout=30
        )
        assert ok.returncode == 0
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    down = subprocess.run(
        [sys.executable, str(HEALTHCHECK)], env={**os.environ, "LLMCTL_PORT": str(closed)}, timeout=30
    )
    assert down.returncode == 1
