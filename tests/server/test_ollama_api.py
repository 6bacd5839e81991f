"""The Ollama API through the official ``ollama`` client against real ``llmctl serve`` processes: the
deterministic thinking model (tests/reasoning_model.py) for ``think``, options and the final
object; the random-weight model for ``format``, raw prompts, errors and disconnects."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import ollama
import pytest
import reasoning_model
from server_helpers import API_KEY, scrape, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ABORTED = 'llmctl:request_success_total{"finished_reason": "abort", "model_name": "tiny-random-llama"}'
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


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


def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers=AUTH, timeout=120)


def text(thinker, key) -> str:
    return thinker["tokenizer"].decode(thinker[key])


GREEDY = {"temperature": 0}
ALPHA = [{"role": "user", "content": "alpha"}]


def test_chat_streams_by_default_with_thinking_and_ends_with_the_durations(think_server, thinker):
    parts = list(client(think_server).chat(model="thinker", messages=ALPHA, options=GREEDY, stream=True))
    *chunks, final = parts
    assert not any(c.done for c in chunks) and final.done and final.done_reason == "stop"
    assert "".join(c.message.thinking or "" for c in chunks) == text(thinker, "reasoning")
    assert "".join(c.message.content or "" for c in chunks) == text(thinker, "answer")
    assert final.prompt_eval_count == 1
    assert final.eval_count == len(thinker["reasoning"]) + len(thinker["answer"]) + 3
    assert all(isinstance(final[k], int) for k in DURATIONS)
    assert final.total_duration >= final.prompt_eval_duration + final.eval_duration > 0
    raw = httpx.post(
        f"{think_server.url}/api/chat", headers=AUTH, json={"model": "thinker", "messages": ALPHA, "options": GREEDY}
    )
    assert raw.headers["content-type"].startswith("application/x-ndjson")  # stream: true is the default
    assert len(raw.text.splitlines()) == len(parts) and json.loads(raw.text.splitlines()[-1])["done"]


def test_chat_whole_think_false_and_levels(think_server, thinker):
    whole = client(think_server).chat(model="thinker:latest", messages=ALPHA, options=GREEDY)
    assert whole.done and whole.message.thinking == text(thinker, "reasoning")
    assert whole.message.content == text(thinker, "answer")
    plain = client(think_server).chat(model="thinker", messages=ALPHA, options=GREEDY, think=False)
    assert plain.message.thinking is None and plain.message.content == text(thinker, "answer")
    leveled = client(think_server).chat(model="thinker", messages=ALPHA, options=GREEDY, think="low")
    assert leveled.message.content == text(thinker, "answer")  # "effort=low" leads the prompt


def test_generate_with_options(think_server, thinker):
    answer = client(think_server).generate(model="thinker", prompt="alpha", options=GREEDY)
    assert answer.thinking == text(thinker, "reasoning") and answer.response == text(thinker, "answer")
    assert answer.done_reason == "stop" and answer.prompt_eval_count == 1
    stopped = client(think_server).generate(model="thinker", prompt="alpha", options={**GREEDY, "stop": ["blue"]})
    assert stopped.response == text(thinker, "answer").split("blue")[0]
    cut = client(think_server).generate(model="thinker", prompt="alpha", options={**GREEDY, "num_predict": 3})
    assert cut.done_reason == "length" and cut.eval_count == 3
    ignored = {"num_ctx": 4096, "num_gpu": 1, "num_thread": 2, "mirostat": 0, "typical_p": 1.0, "unknown_knob": 7}
    sampled = client(think_server).generate(
        model="thinker",
        prompt="alpha",
        options={**ignored, "temperature": 0.5, "top_k": 5, "top_p": 0.9, "min_p": 0.01, "seed": 3},
        think=False,
        keep_alive="5m",
    )
    again = client(think_server).generate(
        model="thinker",
        prompt="alpha",
        options={"temperature": 0.5, "top_k": 5, "top_p": 0.9, "min_p": 0.01, "seed": 3},
        think=False,
    )
    assert sampled.response == again.response
    streamed = list(client(think_server).generate(model="thinker", prompt="alpha", options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == answer.response and streamed[-1].done
    loaded = client(think_server).generate(model="thinker", prompt="")
    assert loaded.done and loaded.done_reason == "load"


def test_format_json_and_schema(tiny_server):
    c = client(tiny_server)
    schema = c.chat(
        model="tiny-random-llama",
        messages=[{"role": "user", "content": "A person?"}],
        format=PERSON,
        options={"seed": 1, "num_predict": 200},
        stream=False,
    )
    jsonschema.validate(json.loads(schema.message.content), PERSON)
    obj = c.generate(model="tiny-random-llama", prompt="JSON:", format="json", options={"seed": 2, "num_predict": 120})
    assert obj.done_reason == "length" or isinstance(json.loads(obj.response), dict)


def test_raw_generate_and_tool_messages(tiny_server):
    c = client(tiny_server)
    raw = c.generate(
        model="tiny-random-llama", prompt="Once upon a time", raw=True, options={"num_predict": 5, "seed": 1}
    )
    assert raw.done_reason == "length" and raw.eval_count == 5
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "4 C", "tool_name": "get_weather"},
    ]
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    answer = c.chat(model="tiny-random-llama", messages=messages, tools=[tool], options={"num_predict": 4, "seed": 1})
    assert answer.done and answer.eval_count <= 4


def test_model_endpoints(think_server):
    c = client(think_server)
    tags = c.list()
    assert [m.model for m in tags.models] == ["thinker"]
    assert tags.models[0].details.family == "llama" and tags.models[0].size > 0
    shown = c.show("thinker")
    assert "thinking" in shown.capabilities and "completion" in shown.capabilities
    assert shown.modelinfo["llama.context_length"] == 256 and "<think>" in shown.template
    running = c.ps()
    assert running.models[0].model == "thinker" and running.models[0].context_length == 256
    assert httpx.get(f"{think_server.url}/api/version", headers=AUTH).json()["version"]


def test_errors_are_ollamas_and_the_server_stays_up(think_server, tiny_server):
    c = client(think_server)
    cases = [
        (dict(model="llama3.2", messages=ALPHA), 404, "not found"),
        (dict(model="thinker", messages=[{"role": "user", "content": "hi", "images": [b"\x89PNG"]}]), 400, "images"),
        (dict(model="thinker", messages=ALPHA, options={"mirostat": 2}), 400, "mirostat"),
        (
            dict(model="thinker", messages=ALPHA, options={"repeat_penalty": 1.2, "repeat_last_n": 64}),
            400,
            "repeat_last_n",
        ),
        (dict(model="thinker", messages=ALPHA, options={"num_predict": 999}), 400, "num_predict"),
    ]
    for kwargs, status, needle in cases:
        with pytest.raises(ollama.ResponseError) as error:
            c.chat(**kwargs, stream=False)
        assert error.value.status_code == status and needle in error.value.error, (kwargs, error.value)
    with pytest.raises(ollama.ResponseError) as error:
        client(tiny_server).chat(model="tiny-random-llama", messages=ALPHA, think=True)
    assert error.value.status_code == 400 and "thinking" in error.value.error
    with pytest.raises(ollama.ResponseError) as error:
        c.generate(model="thinker", prompt="hi", template="{{ .Prompt }}")
    assert error.value.status_code == 400 and "template" in error.value.error
    http = httpx.Client(base_url=think_server.url, timeout=30)
    r = http.post("/api/chat", json={"model": "thinker", "messages": ALPHA, "format": "yaml"}, headers=AUTH)
    assert r.status_code == 400 and "format" in r.json()["error"]
    r = http.post("/api/chat", content=b"{oops", headers=AUTH)
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = http.post("/api/chat", json={"model": "thinker", "messages": ALPHA})
    assert r.status_code == 401 and set(r.json()) == {"error"}
    r = http.post("/api/pull", json={"model": "x"}, headers=AUTH)
    assert r.status_code == 404 and set(r.json()) == {"error"}
    assert http.get("/health").json()["status"] == "ok"
    assert c.chat(model="thinker", messages=ALPHA, options=GREEDY).done_reason == "stop"


def test_a_dropped_stream_aborts_and_every_block_comes_back(tiny_server):
    http = httpx.Client(base_url=tiny_server.url, headers=AUTH, timeout=60)
    aborted_before = scrape(http)["llmctl:request_success"].get(ABORTED, 0.0)
    body = {
        "model": "tiny-random-llama",
        "messages": [{"role": "user", "content": "A long story."}],
        "options": {"num_predict": 400},
    }

    async def drop(c: httpx.AsyncClient) -> int:
        lines = 0
        async with c.stream("POST", "/api/chat", json=body) as response:
            assert response.status_code == 200
            async for _ in response.aiter_lines():
                lines += 1
                if lines == 3:
                    break
        return lines

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=AUTH, timeout=60) as c:
            return await asyncio.gather(*(drop(c) for _ in range(3)))

    assert asyncio.run(main()) == [3, 3, 3]
    stats = wait_until(
        lambda: (s := http.get("/v1/engine/stats").json())["kv"]["used"] == 0 and not s["requests"] and s
    )
    assert stats["kv"]["shared"] == 0
    assert scrape(http)["llmctl:request_success"][ABORTED] - aborted_before >= 1


def test_ollama_port_serves_the_same_api_on_a_second_port(start_server):
    server = start_server(
        "tiny-random-llama", "--max-model-len", "128", "--kv-cache-memory", "16MiB", "--ollama-port", "0"
    )
    found = re.search(r"llmctl serve: also at (http://127\.0\.0\.1:(\d+)) \(--ollama-port\)", server.log())
    assert found is not None, server.log()
    assert int(found.group(2)) != int(server.url.rsplit(":", 1)[1])
    second = ollama.Client(host=found.group(1), timeout=120)
    assert [m.model for m in second.list().models] == [m.model for m in ollama.Client(host=server.url).list().models]
    answer = second.generate(model="tiny-random-llama", prompt="hello", options={"temperature": 0, "num_predict": 4})
    first = ollama.Client(host=server.url).generate(
        model="tiny-random-llama", prompt="hello", options={"temperature": 0, "num_predict": 4}
    )
    assert answer.response == first.response and answer.eval_count == 4
