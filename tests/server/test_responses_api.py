"""OpenAI's Responses API through the official ``openai`` client (``client.responses.create``) against
real ``llmctl serve`` processes: the deterministic thinking model (tests/reasoning_model.py) for
reasoning items, statuses and the event sequence; the random-weight model for structured outputs,
function calls, errors and disconnects."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
import reasoning_model
from server_helpers import API_KEY, scrape, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ABORTED = 'llmctl:request_success_total{"finished_reason": "abort", "model_name": "tiny-random-llama"}'
CHOICE = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Paris"]}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


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


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def text(thinker, key) -> str:
    return thinker["tokenizer"].decode(thinker[key])


def test_reasoning_item_and_output_text(think_server, thinker):
    response = client(think_server).responses.create(model="thinker", input="alpha", temperature=0)
    assert response.status == "completed" and response.store is False and response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == text(thinker, "reasoning")
    assert response.output_text == text(thinker, "answer")
    assert response.usage.output_tokens_details.reasoning_tokens == len(thinker["reasoning"]) + 2
    assert response.usage.input_tokens == 1


def test_stream_events_join_to_the_whole_response(think_server, thinker):
    kwargs = dict(model="thinker", input=[{"role": "user", "content": "alpha"}], temperature=0)
    events = list(client(think_server).responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == text(thinker, "reasoning")
    joined = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert joined == text(thinker, "answer") == next(e.text for e in events if e.type == "response.output_text.done")
    for kind in ("response.output_item.added", "response.output_item.done"):
        assert [e.item.type for e in events if e.type == kind] == ["reasoning", "message"]
    assert kinds.count("response.content_part.added") == kinds.count("response.content_part.done") == 1
    final = events[-1].response
    assert final.output_text == text(thinker, "answer") and final.usage.output_tokens > 0
    with client(think_server).responses.stream(**kwargs) as stream:
        assert stream.get_final_response().output_text == text(thinker, "answer")


def test_instructions_incomplete_and_effort(think_server, thinker):
    cut = client(think_server).responses.create(model="thinker", input="alpha", temperature=0, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    events = list(
        client(think_server).responses.create(
            model="thinker", input="alpha", temperature=0, max_output_tokens=9, stream=True
        )
    )
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    guided = client(think_server).responses.create(
        model="thinker",
        instructions="",
        input=[
            {"role": "developer", "content": ""},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "alpha"}]},
        ],
        temperature=0,
        reasoning={"effort": "low"},
    )
    assert guided.output_text == text(thinker, "answer") and guided.reasoning.effort == "low"


def test_json_schema_format(tiny_server):
    response = client(tiny_server).responses.create(
        model="tiny-random-llama",
        input="Yes or no?",
        text={"format": {"type": "json_schema", "name": "choice", "schema": CHOICE, "strict": True}},
        max_output_tokens=200,
    )
    jsonschema.validate(json.loads(response.output_text), CHOICE)


def test_forced_function_call_and_its_output_as_input(tiny_server):
    c = client(tiny_server)
    kwargs = dict(
        model="tiny-random-llama",
        input="Weather in Oslo?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        temperature=0.7,
    )
    response = c.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city", "unit"}
    events = list(c.responses.create(**kwargs, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert len(done) == 1 and done[0].arguments == deltas and set(json.loads(deltas)) == {"city", "unit"}
    follow_up = c.responses.create(
        model="tiny-random-llama",
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "4 C"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=5,
    )
    assert follow_up.output[0].type == "message"


def test_errors_and_the_server_stays_up(think_server):
    c = client(think_server)
    cases = [
        (dict(previous_response_id="resp_123"), "previous_response_id"),
        (
            dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]),
            "input_image",
        ),
        (dict(tools=[{"type": "web_search"}]), "function tools only"),
        (dict(max_output_tokens=999), "max_output_tokens"),
        (dict(text={"format": {"type": "json_schema", "name": "x"}}), "schema"),
        (dict(background=True), "background"),
    ]
    for extra, needle in cases:
        kwargs = {"model": "thinker", "input": "alpha", **extra}
        with pytest.raises(openai.BadRequestError) as error:
            c.responses.create(**kwargs)
        assert needle in error.value.message, (extra, error.value.message)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="gpt-5", input="hi")
    assert httpx.get(f"{think_server.url}/health").json()["status"] == "ok"
    assert c.responses.create(model="thinker", input="alpha", temperature=0).status == "completed"


def test_a_dropped_stream_aborts_and_every_block_comes_back(tiny_server):
    http = httpx.Client(base_url=tiny_server.url, headers=AUTH, timeout=60)
    aborted_before = scrape(http)["llmctl:request_success"].get(ABORTED, 0.0)
    body = {"model": "tiny-random-llama", "input": "A long story.", "max_output_tokens": 400, "stream": True}

    async def drop(c: httpx.AsyncClient) -> int:
        deltas = 0
        async with c.stream("POST", "/v1/responses", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                deltas += line == "event: response.output_text.delta"
                if deltas == 3:
                    break
        return deltas

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=AUTH, timeout=60) as c:
            return await asyncio.gather(*(drop(c) for _ in range(3)))

    assert asyncio.run(main()) == [3, 3, 3]
    stats = wait_until(
        lambda: (s := http.get("/v1/engine/stats").json())["kv"]["used"] == 0 and not s["requests"] and s
    )
    assert stats["kv"]["shared"] == 0
    assert scrape(http)["llmctl:request_success"][ABORTED] - aborted_before >= 1
