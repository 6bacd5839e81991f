"""Every error in OpenAI's error JSON, over raw HTTP: malformed JSON, bad parameters, over-long
prompts (400), a missing or wrong API key (401), an unknown model (404), a full queue (503)."""

from __future__ import annotations

import concurrent.futures
import socket

import httpx
import pytest
from server_helpers import API_KEY

from llmctl.server.protocol import ErrorResponse


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    ErrorResponse.model_validate(body)  # {"error": {"message", "type", "param", "code"}}
    return body["error"]


def completion(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "stories", "prompt": "Once upon a time", **body})


def test_malformed_json_is_400(http):
    for raw in (
        b'{"prompt": "Once upon',
        b"not json at all",
        b"\xff\xfe",
        b'{"prompt": "\\udcff"}',
        b'{"prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    ):
        error = error_of(http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"}), 400)
        assert error["type"] == "invalid_request_error" and "malformed JSON" in error["message"]
    error = error_of(http.post("/v1/chat/completions", content=b"[1, 2]"), 400)
    assert "JSON object" in error["message"]
    for raw in (b'{"prompt": "a", "temperature": NaN}', b'{"prompt": "a", "temperature": -Infinity}'):
        error = error_of(http.post("/v1/completions", content=raw), 400)
        assert error["param"] == "temperature" and "finite" in error["message"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"n": 0}, "n", "n must be"),
        ({"temperature": -1}, "temperature", "temperature"),
        ({"top_p": 0}, "top_p", "top_p"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens"),
        ({"max_tokens": "many"}, "max_tokens", "valid integer"),
        ({"logprobs": 21}, "logprobs", "logprobs"),
        ({"stop": [""]}, "stop", "stop"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": [5, 99999]}, "prompt", "token ids"),
        ({"prompt": [5, -1]}, "prompt", "token ids"),
        ({"stream": "yes"}, "stream", "valid boolean"),
        ({"max_tokens": "5"}, "max_tokens", "valid integer"),
        ({"temperature": True}, "temperature", "valid number"),
        ({"n": 1.0}, "n", "valid integer"),
        ({"top_k": "40"}, "top_k", "valid integer"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"min_tokens": 99}, "min_tokens", "max_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"prompt": None}, "prompt", "prompt"),
        ({"seed": 2**70}, "seed", "seed"),
    ],
    ids=lambda v: str(v),
)
def test_bad_parameters_are_400(http, body, param, words):
    error = error_of(completion(http, **body), 400)
    assert words in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_lone_surrogates_nesting_and_non_finite_numbers_are_400_on_chat_too(http):
    for raw in (
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"messages": ' + b"[" * 10000 + b"]" * 10000 + b"}",
    ):
        error = error_of(http.post("/v1/chat/completions", content=raw), 400)
        assert "malformed JSON" in error["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for body, param in (
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ):
        assert error_of(http.post("/v1/chat/completions", json={**chat, **body}), 400)["param"] == param


def test_body_over_the_limit_is_413(http):
    from llmctl.server.app import MAX_BODY_BYTES

    huge = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    error = error_of(http.post("/v1/completions", content=huge), 413)
    assert str(MAX_BODY_BYTES) in error["message"] and error["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 2):
            yield b" " * (1 << 20)

    error = error_of(http.post("/v1/completions", content=chunked()), 413)
    assert error["code"] == "request_too_large"
    assert http.get("/health").json() == {"status": "ok"}


def test_bad_chat_parameters_are_400(http):
    for body, words in (
        ({"messages": []}, "empty"),
        ({}, "messages: Field required"),
        ({"messages": [{"content": "no role"}]}, "role"),
        ({"messages": [{"role": "bogus", "content": "Hi"}]}, "role"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "logprobs: true"),
    ):
        error = error_of(http.post("/v1/chat/completions", json={"model": "stories", **body}), 400)
        assert words in error["message"]


def test_over_long_prompts_are_400(http):
    long_prompt = "Lily saw a big red ball. " * 100  # far more than max_model_len = 512 tokens
    error = error_of(completion(http, prompt=long_prompt), 400)
    assert "max_model_len is 512" in error["message"]  # the engine's own message
    error = error_of(completion(http, prompt="Lily saw a big red ball. " * 30, max_tokens=400), 400)
    assert "maximum context length is 512 tokens" in error["message"] and error["param"] == "max_tokens"


def test_harmless_fields_are_accepted_and_unknown_ones_refused(http):
    harmless = dict(metadata={"who": "test"}, store=False, frequency_penalty=0, logit_bias={}, best_of=1)
    r = completion(http, max_tokens=3, temperature=0, **harmless)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ", there was"
    error = error_of(completion(http, max_tokens=3, temperature=0, **harmless, some_future_field=[1, 2]), 400)
    assert error["param"] == "some_future_field" and "some_future_field" in error["message"]


def test_api_key_is_required_on_v1_only(stories_server):
    with httpx.Client(base_url=stories_server.url, timeout=30) as anonymous:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            error = error_of(anonymous.post("/v1/completions", json={"prompt": "x"}, headers=headers), 401)
            assert error["code"] == "invalid_api_key"
        error_of(anonymous.get("/v1/models"), 401)
        error_of(anonymous.get("/v1/engine/stats"), 401)
        assert anonymous.get("/health").json() == {"status": "ok"}
        assert anonymous.get("/metrics").status_code == 200


def test_unknown_model_and_route_are_404(http):
    error = error_of(completion(http, model="gpt-4o"), 404)
    assert error["code"] == "model_not_found" and "gpt-4o" in error["message"]
    chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    assert error_of(http.post("/v1/chat/completions", json=chat), 404)["code"] == "model_not_found"
    assert "no route" in error_of(http.get("/v1/nothing-here"), 404)["message"]


def test_refused_requests_allocate_nothing(http):
    completion(http, prompt="Lily saw a big red ball. " * 100)
    stats = http.get("/v1/engine/stats").json()
    assert stats["kv"]["used"] == stats["kv"]["shared"] == 0 and stats["requests"] == []


def test_full_queue_is_503_with_retry_after(start_server, stories_dir):
    """One sequence runs at a time and one may wait: a burst of eight leaves the rest refused."""
    server = start_server(str(stories_dir), "--max-num-seqs", "1", "--max-queue", "1", "--kv-cache-memory", "16MiB")
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=16)) as client:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda _: client.post("/v1/completions", json=body), range(8)))
    refused = [r for r in responses if r.status_code == 503]
    served = [r for r in responses if r.status_code == 200]
    assert refused and served and len(refused) + len(served) == 8
    for r in refused:
        assert int(r.headers["Retry-After"]) >= 1
        assert error_of(r, 503)["code"] == "queue_full"
    assert all(r.json()["usage"]["completion_tokens"] == 200 for r in served)


def test_a_client_gone_before_its_body_ends_is_no_server_error(stories_server, http):
    """A POST that declares more body than it sends and hangs up: the server logs no traceback,
    holds nothing, and answers the next request."""
    host, port = stories_server.url.removeprefix("http://").split(":")
    for path in ("/v1/completions", "/v1/chat/completions"):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
                "Content-Type: application/json\r\nContent-Length: 4000\r\n\r\n".encode()
                + b'{"model": "stories", "prompt": "Once upon'
            )
            sock.shutdown(socket.SHUT_WR)  # the server sees the end of the stream mid-body ...
            while sock.recv(4096):  # ... and has finished with the request once it closes its side
                pass
    assert completion(http, max_tokens=2).status_code == 200
    assert "Traceback" not in stories_server.log() and "ClientDisconnect" not in stories_server.log()
    stats = http.get("/v1/engine/stats").json()
    assert stats["kv"]["used"] == 0 and stats["requests"] == []
