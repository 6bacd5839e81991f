"""A live ``llmctl serve`` for the HTTP target's tests: a real subprocess on a free port, stopped
with SIGTERM at the end of the session."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

READY = re.compile(r"at (http://\S+)/v1")
START_TIMEOUT_S = 90


@pytest.fixture(scope="session")
def live_server() -> Iterator[str]:
    """The base URL (``http://127.0.0.1:PORT``) of ``llmctl serve tiny-random-llama``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmctl.cli",
            "serve",
            "tiny-random-llama",
            "--port",
            "0",
            "--threads",
            "1",
            "--kv-cache-memory",
            "256MiB",
            "--log-level",
            "warning",
            "--no-access-log",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:  # keeps draining the pipe so the server never blocks on a full one
        for line in proc.stdout:
            lines.append(line)
            match = READY.search(line)
            if match and not found:
                found.append(match.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(START_TIMEOUT_S)
    if not found:
        proc.kill()
        proc.wait()
        pytest.fail("llmctl serve did not start:\n" + "".join(lines[-30:]))
    try:
        yield found[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
