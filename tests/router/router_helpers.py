"""Real ``llmctl serve`` replicas and ``llmctl router`` processes on 127.0.0.1, for the router tests
and benchmarks/features/router.py alike."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180
# 12 MiB of fp32 KV is 48 blocks of
# 16 tokens: about six of the workload's system prompts, so a replica that sees all eight evicts
REPLICA_FLAGS = (
    "--threads",
    "1",
    "--dtype",
    "float32",
    "--kv-cache-memory",
    "12MiB",
    "--max-num-seqs",
    "8",
    "--log-level",
    "warning",
    "--no-access-log",
)
WORDS = (
    "river dragon garden train moon engine story page memory pool block token step cache batch "
    "queue prefix budget decode"
).split()


class Process:
    """A command whose log names its URL once it is ready; killed at the end of the test."""

    def __init__(self, command: list[str], ready: str, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        # float32 runs the plain torch references, so the native CPU kernels are not even loaded
        # (loading them may wait on another process's build of them)
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "TOKENIZERS_PARALLELISM": "false",
            "LLMCTL_NATIVE_CPU_KERNELS": "0",
        }
        self.proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.ready = re.compile(ready)
        self.url = ""

    def wait_ready(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if match := self.ready.search(self.log()):
                self.url = match.group(1)
                return self.url
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"{self.log_path.name} did not start:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def start_replicas(count: int, log_dir: Path, *extra: str) -> list[Process]:
    """``count`` servers of the embedded model, started together, each on a free port."""
    replicas = [
        Process(
            [
                sys.executable,
                "-m",
                "llmctl.cli",
                "serve",
                "tiny-random-llama",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                *REPLICA_FLAGS,
                *extra,
            ],
            r"llmctl serve: .* at (http://127\.0\.0\.1:\d+)/v1",
            log_dir / f"replica{i}.log",
        )
        for i in range(count)
    ]
    try:
        for replica in replicas:
            replica.wait_ready()
    except BaseException:
        for replica in replicas:
            replica.kill()
        raise
    return replicas


def start_router(replica_urls: list[str], log_dir: Path, *flags: str, expect_healthy: int | None = None) -> Process:
    """A router over ``replica_urls`` (or what its flags discover), ready once ``expect_healthy``
    replicas (default: all of ``replica_urls``) are in its rotation."""
    command = [
        sys.executable,
        "-m",
        "llmctl.router",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--log-level",
        "warning",
        *[arg for url in replica_urls for arg in ("--replica", url)],
        *flags,
    ]
    name = "router-" + "-".join(f.strip("-") for f in flags[:2])
    router = Process(command, r"llmctl router: .* at (http://127\.0\.0\.1:\d+)/v1", log_dir / f"{name}.log")
    router.wait_ready()
    deadline = time.monotonic() + 30
    expected = len(replica_urls) if expect_healthy is None else expect_healthy
    while httpx.get(f"{router.url}/health").json()["healthy_replicas"] < expected:
        assert time.monotonic() < deadline, "the router never saw every replica healthy"
        time.sleep(0.1)
    return router


def system_prompt(index: int) -> str:
    """About 300 bytes (~100 tokens of the embedded model): six or seven KV blocks. The prompts
    differ from their first token on (a shared opening like "System prompt" would put a common
    first KV block, cached everywhere, into every policy's hit rate)."""
    pick = random.Random(index)
    return f"{index}. " + " ".join(pick.choice(WORDS) for _ in range(48))


def question(index: int) -> str:
    pick = random.Random(10_000 + index)
    return f"Question {index}: " + " ".join(pick.choice(WORDS) for _ in range(5)) + "?"


def shared_prefix_workload(systems: range, questions: int, max_tokens: int = 2) -> list[dict]:
    """Every system prompt with every question, interleaved (s0 q0, s1 q0, ..., s0 q1, ...)."""
    return [
        {
            "messages": [{"role": "system", "content": system_prompt(s)}, {"role": "user", "content": question(q)}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        for q in range(questions)
        for s in systems
    ]


def prefix_cache_counters(urls: list[str]) -> tuple[float, float]:
    """(queried, hit) prompt tokens summed over the replicas' /metrics."""
    queried = hit = 0.0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            for sample in family.samples:
                if sample.name == "llmctl:prefix_cache_queries_total":
                    queried += sample.value
                elif sample.name == "llmctl:prefix_cache_hits_total":
                    hit += sample.value
    return queried, hit


def metric_value(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
