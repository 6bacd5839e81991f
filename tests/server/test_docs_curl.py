"""docs/server.md's one-curl-per-endpoint block runs as written against a live ``llmctl serve
tiny-random-llama``: every command exits 0 (``curl -f``: no HTTP error) and answers what its
endpoint answers, and every route the app serves is in the block or named beside it."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "server.md"
MARKER = "<!-- curl-per-endpoint -->"


def commands() -> list[str]:
    text = DOC.read_text()
    block = text[text.index(MARKER) :].split("```console\n", 1)[1].split("```", 1)[0]
    return [line.removeprefix("$ ") for line in block.splitlines() if line.startswith("$ curl")]


def route_of(command: str) -> str:
    return re.search(r"localhost:8000(/[^\s']*)", command).group(1)


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("tiny-random-llama", "--max-model-len", "256", "--kv-cache-memory", "16MiB")


def test_every_curl_of_the_docs_answers(server):
    for command in commands():
        argv = [server.url + route_of(command) if a.startswith("localhost:8000") else a for a in shlex.split(command)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        if route_of(command) != "/metrics":
            json.loads(done.stdout)  # every JSON endpoint answered JSON


def test_the_block_covers_every_route_of_the_app():
    app_source = (Path(__file__).resolve().parents[2] / "llmctl" / "server" / "app.py").read_text()
    served = set(re.findall(r'@app\.(?:get|post|delete)\("([^"]*)"', app_source))
    named_beside = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/rerank", "/v1/score"}
    named_beside.add("/v1/engine/stats/stream")
    assert served and served == {route_of(c) for c in commands()} | named_beside
