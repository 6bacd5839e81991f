"""Anthropic's Messages API through the official ``anthropic`` client against real ``llmctl serve``
processes: the deterministic thinking model (tests/reasoning_model.py) for thinking blocks, stop
reasons and the event sequence; the random-weight model for tools and disconnects."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import pytest
import reasoning_model
from server_helpers import API_KEY, scrape, wait_until

WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Paris"]}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ABORTED = 'llmctl:request_success_total{"finished_reason": "abort", "model_name": "tiny-random-llama"}'


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> dict:
    return reasoning_model.build(tmp_path_factory.mktemp("thinker") / "model")


@pytest.fixture(scope="module")
def think_server(start_server, thinker):
    return start_server(
        thinker["dir"],
        "--reasoning-parser",
        "auto",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
        "--served-model-name",
        "thinker",
        "--api-key",
        API_KEY,
    )


@pytest.fixture(scope="module")
def tiny_server(start_server):
    return start_server(
        "tiny-random-llama", "--max-model-len", "512", "--kv-cache-memory", "64MiB", env={"LLMCTL_API_KEY": API_KEY}
    )


def client(server, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120, **kwargs)


def text(thinker, key) -> str:
    return thinker["tokenizer"].decode(thinker[key])


def ask(server, content="alpha", **kwargs):
    kwargs.setdefault("max_tokens", 64)
    kwargs.setdefault("extra_body", {"temperature": 0})  # the client no longer names temperature
    return client(server).messages.create(model="thinker", messages=[{"role": "user", "content": content}], **kwargs)


def test_thinking_and_text_blocks(think_server, thinker):
    message = ask(think_server)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == text(thinker, "reasoning")
    assert message.content[1].text == text(thinker, "answer")
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.role == "assistant" and message.id.startswith("msg_")
    assert message.usage.output_tokens == len(thinker["reasoning"]) + len(thinker["answer"]) + 3
    assert message.usage.input_tokens == 1


def test_stream_sends_anthropics_events_and_joins_to_the_whole_answer(think_server, thinker):
    whole = ask(think_server)
    events = list(ask(think_server, stream=True))  # the client leaves out the pings
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    raw = httpx.post(
        f"{think_server.url}/v1/messages",
        headers={"x-api-key": API_KEY},
        json={"model": "thinker", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "alpha"}]},
        timeout=60,
    )
    names = [line.removeprefix("event: ") for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names[:4] == ["message_start", "content_block_start", "ping", "content_block_delta"]
    assert names.count("ping") == 1 and names[-2:] == ["message_delta", "message_stop"]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas.count("thinking_delta") >= 3 and deltas.count("text_delta") >= 2
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    with client(think_server).messages.stream(
        model="thinker", max_tokens=64, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "alpha"}]
    ) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", text(thinker, "reasoning")),
        ("text", text(thinker, "answer")),
    ]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequence_and_max_tokens(think_server, thinker):
    stopped = ask(think_server, stop_sequences=["blue"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "blue"
    assert stopped.content[-1].text == text(thinker, "answer").split("blue")[0]
    streamed = list(ask(think_server, stop_sequences=["blue"], stream=True))
    assert streamed[-2].delta.stop_reason == "stop_sequence" and streamed[-2].delta.stop_sequence == "blue"
    cut = ask(think_server, max_tokens=3)
    assert cut.stop_reason == "max_tokens" and [b.type for b in cut.content] == ["thinking"]
    assert cut.usage.output_tokens == 3


def test_thinking_disabled_and_system_blocks(think_server, thinker):
    message = ask(think_server, thinking={"type": "disabled"}, system=[{"type": "text", "text": ""}])
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == text(thinker, "answer")


def test_conversation_with_thinking_tool_use_and_tool_result_blocks(think_server, thinker):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "ask the tool", "signature": ""},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo", "unit": "c"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "4 C\n"}]},
                {"type": "text", "text": "alpha"},
            ],
        },
    ]
    answer = client(think_server).messages.create(
        model="thinker", max_tokens=64, extra_body={"temperature": 0}, messages=messages, tools=[WEATHER]
    )
    assert answer.content[-1].text == text(thinker, "answer")
    counted = client(think_server).messages.count_tokens(model="thinker", messages=messages, tools=[WEATHER])
    assert counted.input_tokens == answer.usage.input_tokens


def test_forced_tool_use_whole_and_streamed(tiny_server):
    kwargs = dict(
        model="tiny-random-llama",
        max_tokens=200,
        extra_body={"temperature": 0.7, "top_k": 50, "top_p": 0.9},
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        metadata={"user_id": "u1"},
    )
    whole = client(tiny_server).messages.create(**kwargs)
    calls = [b for b in whole.content if b.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and len(calls) == 1
    assert calls[0].name == "get_weather" and set(calls[0].input) == {"city", "unit"}
    with client(tiny_server).messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and streamed[0].name == "get_weather"
    assert set(streamed[0].input) == {"city", "unit"}


def test_errors_are_anthropics_and_the_server_stays_up(think_server):
    c = client(think_server)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.create(model="thinker", max_tokens=8, messages=[{"role": "user", "content": [image]}])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        c.messages.create(model="claude-sonnet", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as auth:
        anthropic.Anthropic(base_url=think_server.url, api_key="wrong", max_retries=0).messages.create(
            model="thinker", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert auth.value.body["error"]["type"] == "authentication_error"
    raw = httpx.Client(base_url=think_server.url, headers={"x-api-key": API_KEY}, timeout=30)
    hi = [{"role": "user", "content": "hi"}]
    document = [{"role": "user", "content": [{"type": "document"}]}]
    server_tool = {"type": "web_search_20250305", "name": "w", "input_schema": {}}
    for body, needle in [
        ({"model": "thinker", "messages": hi}, "max_tokens"),
        ({"model": "thinker", "max_tokens": 8, "temperature": 1.5, "messages": []}, "temperature"),
        ({"model": "thinker", "max_tokens": 999, "messages": hi}, "max_tokens"),
        ({"model": "thinker", "max_tokens": 8, "messages": document}, "document"),
        ({"model": "thinker", "max_tokens": 8, "tools": [server_tool], "messages": hi}, "server tools"),
        (
            {"model": "thinker", "max_tokens": 8, "messages": hi, "output_config": {"format": {"type": "x"}}},
            "output_config",
        ),
    ]:
        r = raw.post("/v1/messages", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and needle in r.json()["error"]["message"], r.text
    r = raw.post("/v1/messages", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert raw.get("/health").json()["status"] == "ok"
    assert ask(think_server).stop_reason == "end_turn"


def test_a_dropped_stream_aborts_and_every_block_comes_back(tiny_server):
    http = httpx.Client(base_url=tiny_server.url, headers={"x-api-key": API_KEY}, timeout=60)
    aborted_before = scrape(http)["llmctl:request_success"].get(ABORTED, 0.0)
    body = {
        "model": "tiny-random-llama",
        "max_tokens": 400,
        "stream": True,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    }

    async def drop(c: httpx.AsyncClient) -> int:
        deltas = 0
        async with c.stream("POST", "/v1/messages", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                deltas += line.startswith("event: content_block_delta")
                if deltas == 3:
                    break
        return deltas

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=tiny_server.url, headers={"x-api-key": API_KEY}, timeout=60) as c:
            return await asyncio.gather(*(drop(c) for _ in range(3)))

    assert asyncio.run(main()) == [3, 3, 3]
    stats = wait_until(
        lambda: (s := http.get("/v1/engine/stats").json())["kv"]["used"] == 0 and not s["requests"] and s
    )
    assert stats["kv"]["shared"] == 0
    assert scrape(http)["llmctl:request_success"][ABORTED] - aborted_before >= 1
    assert json.loads(http.get("/health").text)["status"] == "ok"


def test_structured_output_from_output_config(tiny_server):
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,  # else a noise model writes a key of its own, unbounded
    }
    message = client(tiny_server).messages.create(
        model="tiny-random-llama",
        max_tokens=450,  # a noise model may pad with the (bounded) whitespace the grammar allows
        messages=[{"role": "user", "content": "Yes or no?"}],
        extra_body={"temperature": 0},
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert json.loads(message.content[0].text)["answer"] in ("yes", "no")
