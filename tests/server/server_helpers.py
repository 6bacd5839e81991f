"""A real ``llmctl serve`` process for tests, metrics scraping and polling."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
READY = re.compile(r"llmctl serve: .* at (http://127\.0\.0\.1:(\d+))/v1")
STARTUP_TIMEOUT_S = 300  # a busy CI machine can take minutes to import torch


class ServerProcess:
    """``python -m llmctl.cli serve MODEL --port 0 ...``; the URL comes from its startup line."""

    def __init__(
        self,
        model: str,
        *args: str,
        log_path: Path,
        env: dict[str, str] | None = None,
        launcher: tuple[str, ...] = ("-m", "llmctl.cli"),
    ) -> None:
        self.log_path = log_path
        command = [
            sys.executable,
            *launcher,
            "serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--threads",
            "1",
            "--log-level",
            "warning",
            "--no-access-log",
            *args,
        ]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.url = self._wait_ready()
        self.base_url = f"{self.url}/v1"

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if (match := READY.search(self.log())) is not None:
                return match.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"server did not start:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM, then wait for the drained exit; the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def wait_until(predicate: Callable[[], object], timeout: float = 30, interval: float = 0.05) -> object:
    """Poll until ``predicate()`` returns something truthy; that value, or AssertionError."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value: {value!r})")
        time.sleep(interval)


def scrape(http: httpx.Client) -> dict[str, dict[str, float]]:
    """family name -> {sample name + labels: value}."""
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = {}
    for family in text_string_to_metric_families(response.text):
        families[family.name] = {
            (s.name + json.dumps(s.labels, sort_keys=True) if s.labels.keys() - {"model_name"} else s.name): s.value
            for s in family.samples
        }
        families[family.name]["type"] = family.type
    return families
