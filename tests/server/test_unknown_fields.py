"""Unknown request fields, as OpenAI's and Anthropic's APIs treat them: a 400 that names the field,
on the OpenAI, Anthropic, Responses and embeddings endpoints alike, at the top level and inside
nested objects; fields that change nothing here (``metadata``, ``store``, ``service_tier``, ...)
are accepted and answer as without them; a known field of the wrong type is a 400 too. The Ollama
API ignores unknown fields, as Ollama does."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import API_KEY

ASK = [{"role": "user", "content": "hi"}]
# path -> (a valid body, a nested object of it with an unknown field inside)
ENDPOINTS = {
    "/v1/chat/completions": (
        {"messages": ASK, "max_tokens": 3, "temperature": 0},
        {"response_format": {"type": "text", "unknown_inner": 1}},
    ),
    "/v1/completions": ({"prompt": "hi", "max_tokens": 3, "temperature": 0}, {}),
    "/v1/messages": (
        {"model": "tiny-random-llama", "messages": ASK, "max_tokens": 3, "temperature": 0},
        {"metadata": {"user_id": "u1", "unknown_inner": 1}},
    ),
    "/v1/responses": (
        {"model": "tiny-random-llama", "input": "hi", "max_output_tokens": 3, "temperature": 0},
        {"reasoning": {"effort": None, "unknown_inner": 1}},
    ),
}


@pytest.fixture(scope="module")
def http(chat_server):
    with httpx.Client(base_url=chat_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def answer_text(path: str, body: dict) -> str:
    if path == "/v1/chat/completions":
        return body["choices"][0]["message"]["content"]
    if path == "/v1/completions":
        return body["choices"][0]["text"]
    if path == "/v1/messages":
        return body["content"][0]["text"]
    return body["output"][-1]["content"][0]["text"]


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_an_unknown_field_is_refused_by_name(http, path):
    body, nested = ENDPOINTS[path]
    for extra, name in (({"frobnicate": {"level": 3}}, "frobnicate"), (nested, "unknown_inner")):
        if not extra:
            continue
        refused = http.post(path, json={**body, **extra})
        assert refused.status_code == 400, refused.text
        assert name in refused.text


OPENAI_NO_OPS = {"metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
NO_OPS = {
    "/v1/chat/completions": {**OPENAI_NO_OPS, "parallel_tool_calls": True},
    "/v1/completions": OPENAI_NO_OPS,
    "/v1/messages": {"metadata": {"user_id": "u1"}, "service_tier": "auto"},
    "/v1/responses": {"metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True},
}


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_fields_that_change_nothing_are_accepted(http, path):
    body, _ = ENDPOINTS[path]
    plain = http.post(path, json=body)
    assert plain.status_code == 200, plain.text
    answered = http.post(path, json={**body, **NO_OPS[path]})
    assert answered.status_code == 200, answered.text
    assert answer_text(path, answered.json()) == answer_text(path, plain.json())


def test_the_ollama_api_ignores_unknown_fields_as_ollama_does(http):
    options = {"num_predict": 3, "temperature": 0}
    body = {"model": "tiny-random-llama", "prompt": "hi", "stream": False, "options": options}
    plain = http.post("/api/generate", json=body)
    answered = http.post("/api/generate", json={**body, "frobnicate": 1, "options": {**options, "x": 2}})
    assert plain.status_code == answered.status_code == 200, answered.text
    assert answered.json()["response"] == plain.json()["response"]


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_a_known_field_of_the_wrong_type_is_refused(http, path):
    body, _ = ENDPOINTS[path]
    refused = http.post(path, json={**body, "temperature": "hot"})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert "temperature" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_the_embeddings_endpoint_refuses_an_unknown_field_too(http):
    body = {"model": "tiny-random-llama", "input": "hi"}
    assert http.post("/v1/embeddings", json=body).status_code == 200
    refused = http.post("/v1/embeddings", json={**body, "frobnicate": 1})
    assert refused.status_code == 400 and "frobnicate" in refused.text
