"""Unknown request fields, as vLLM treats them: ignored (the request answers as without them), on
the OpenAI, Anthropic and Responses endpoints alike, at the top level and inside nested objects;
a known field of the wrong type is still a 400 in each API's own error shape."""

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
def test_unknown_fields_are_ignored(http, path):
    body, nested = ENDPOINTS[path]
    plain = http.post(path, json=body)
    assert plain.status_code == 200, plain.text
    extra = {**body, **nested, "frobnicate": {"level": 3}, "another_unknown": [1, 2]}
    answered = http.post(path, json=extra)
    assert answered.status_code == 200, answered.text
    assert answer_text(path, answered.json()) == answer_text(path, plain.json())


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_a_known_field_of_the_wrong_type_is_refused(http, path):
    body, _ = ENDPOINTS[path]
    refused = http.post(path, json={**body, "temperature": "hot"})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert "temperature" in error["message"]
    assert error["type"] == "invalid_request_error"
