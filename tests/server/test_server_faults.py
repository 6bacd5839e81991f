"""Fault isolation through a real server: one request that fails while its output is produced gets
an error of its own and the others go on; a fault in model execution makes the server answer
``/health`` with 503 and exit non-zero within seconds (so that a supervisor restarts it)."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import time

import httpx
import pytest
from server_helpers import REPO_ROOT, wait_until

FAULTY = (str(REPO_ROOT / "tests" / "server" / "faulty_serve.py"),)
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def stream_events(client: httpx.Client, body: dict) -> list:
    events = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def test_a_failing_request_fails_alone(start_server, stories_dir):
    server = start_server(
        str(stories_dir), "--kv-cache-memory", "16MiB", launcher=FAULTY, env={"LLMCTL_TEST_FAULTS": "detokenizer"}
    )
    with httpx.Client(base_url=server.url, timeout=120) as client:
        expected = client.post("/v1/completions", json={"prompt": "Once upon a time", **GREEDY}).json()
        expected_text = expected["choices"][0]["text"]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            good = [
                pool.submit(client.post, "/v1/completions", json={"prompt": "Once upon a time", **GREEDY})
                for _ in range(3)
            ]
            bad = pool.submit(client.post, "/v1/completions", json={"prompt": "FAULT Once upon a time", **GREEDY})
            bad_stream = pool.submit(stream_events, client, {"prompt": "FAULT Lily", **GREEDY})
            good_stream = pool.submit(stream_events, client, {"prompt": "Once upon a time", **GREEDY})
        for response in (future.result() for future in good):
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected_text
        response = bad.result()
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert error["code"] == "request_failed" and "injected detokenizer fault" in error["message"]
        events = bad_stream.result()
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert "injected detokenizer fault" in events[-2]["error"]["message"]
        events = good_stream.result()
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected_text
        assert client.get("/health").json() == {"status": "ok"}
        stats = wait_until(lambda: (s := client.get("/v1/engine/stats").json())["kv"]["used"] == 0 and s)
        assert stats["requests"] == []


def test_an_engine_fault_makes_the_server_exit_non_zero(start_server, stories_dir):
    server = start_server(
        str(stories_dir), "--kv-cache-memory", "16MiB", launcher=FAULTY, env={"LLMCTL_TEST_FAULTS": "forward"}
    )
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.post("/v1/completions", json={"prompt": "Once upon a time", **GREEDY}).status_code == 200
        response = client.post("/v1/completions", json={"prompt": "CRASH now", **GREEDY})
        assert response.status_code == 500 and response.json()["error"]["code"] == "engine_dead"
        failed_at = time.monotonic()
        try:
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "engine_dead"
        except httpx.TransportError:
            pass  # already gone: faster still
    exit_code = server.proc.wait(timeout=15)
    assert time.monotonic() - failed_at < 15
    assert exit_code == 4, server.log()
    assert "the engine loop failed" in server.log() and "injected model execution fault" in server.log()
    assert "Traceback" not in server.log().split("the engine loop failed")[1]


@pytest.fixture(scope="module")
def random_llama_with_byte_fallback(tmp_path_factory, stories_dir):
    """A random-weight Llama with the stories260k tokenizer, whose greedy
    output is a sequence of byte tokens that is not valid UTF-8."""
    from model_factory import make_hf_model

    model_dir = make_hf_model("llama", tmp_path_factory.mktemp("llama") / "random", seed=3, vocab_size=512)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(stories_dir / name, model_dir / name)
    return model_dir


def test_invalid_utf8_generation_is_served(start_server, random_llama_with_byte_fallback):
    server = start_server(str(random_llama_with_byte_fallback), "--kv-cache-memory", "16MiB")
    with httpx.Client(base_url=server.url, timeout=120) as client:
        body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 24
        events = stream_events(client, body)
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == response.json()["choices"][0]["text"]
        assert client.post("/v1/completions", json={**body, "prompt": "Lily"}).status_code == 200
