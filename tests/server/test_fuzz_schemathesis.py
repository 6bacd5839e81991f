"""Fuzzing: schemathesis drives a real server from its own ``/openapi.json`` (bounded: at most
50 examples per operation, after the explicit examples and the coverage phase's boundary values)
and checks that no answer is a 5xx, that nothing hangs (a timeout per request) and that the server
is alive and has freed every KV block afterwards."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
from server_helpers import wait_until

MAX_EXAMPLES = 50  # 100 took two minutes of CI; the coverage phase still sends every boundary value
REQUEST_TIMEOUT_S = 60


def test_schemathesis_finds_no_server_error(start_server, tiny_chat_model, tmp_path):
    # a tiny context and few seats bound the work any generated request can ask for
    server = start_server(tiny_chat_model, "--max-model-len", "48", "--max-num-seqs", "4", "--kv-cache-memory", "32MiB")
    schema = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "prompt" in body["properties"] and "$defs" not in str(schema)  # real, self-contained bodies
    assert "ContentPart" in schema["components"]["schemas"]
    command = [
        str(Path(sys.executable).parent / "schemathesis"),
        "run",
        f"{server.url}/openapi.json",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--request-timeout",
        str(REQUEST_TIMEOUT_S),
        "--seed",
        "11",
        "--exclude-path",
        "/v1/engine/stats/stream",  # an endless stream by design
        "--phases",
        "examples,coverage,fuzzing",
        "--generation-database",
        "none",
        "--report-dir",
        str(tmp_path),
    ]
    # cwd: schemathesis keeps a crash cache in ./.schemathesis; not in the repository
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "Unresolvable" not in result.stdout and " passed" in result.stdout
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/health").json() == {"status": "ok"}
        stats = wait_until(lambda: (s := client.get("/v1/engine/stats").json())["kv"]["used"] == 0 and s, timeout=60)
        assert stats["requests"] == []
