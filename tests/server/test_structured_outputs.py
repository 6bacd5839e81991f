"""Structured outputs, tool calling and the sampling fields, through the official ``openai`` client
against a real ``llmctl serve`` of the random-weight model.

A noise model is the hard case for enforcement: nothing in its weights leans towards valid JSON, so
every valid answer below is the grammar's doing. Seeded sampling is batch-invariant, which is what
lets "batched == alone" and "streaming == non-streaming" be exact comparisons.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from server_helpers import API_KEY
from structured_schemas import PERSON

from llmctl.models.embedded import embedded_tokenizer

PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Tell me about a person."}]
CHOICES = ["red", "green", "blue and gold"]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        "tiny-random-llama",
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "64MiB",
        "--dtype",
        "float32",
        env={"LLMCTL_API_KEY": API_KEY},
    )


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=300)


def chat(client, **kwargs):
    kwargs.setdefault("messages", ASK)
    return client.chat.completions.create(model="tiny-random-llama", **kwargs)


def complete(client, **kwargs):
    return client.completions.create(model="tiny-random-llama", **kwargs)


def concurrently(calls):
    """Send all at once, so that they share engine steps."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def person_ok(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


def test_json_schema_holds_for_every_sample_of_a_mixed_batch(client):
    constrained = [
        lambda s=s: chat(client, response_format=PERSON_FORMAT, seed=s, temperature=1.0, max_tokens=450)
        for s in range(4)
    ]
    constrained.append(lambda: chat(client, response_format=PERSON_FORMAT, n=2, seed=40, max_tokens=450))
    constrained.append(lambda: chat(client, response_format=PERSON_FORMAT, temperature=0, max_tokens=450))
    constrained.append(
        lambda: complete(
            client, prompt="Person:", max_tokens=450, seed=5, extra_body={"response_format": PERSON_FORMAT}
        )
    )
    constrained.append(lambda: chat(client, seed=6, max_tokens=450, extra_body={"guided_json": PERSON}))
    constrained.append(
        lambda: chat(client, seed=7, max_tokens=450, extra_body={"structured_outputs": {"json": PERSON}})
    )
    free = [lambda s=s: chat(client, seed=s, temperature=1.0, max_tokens=40) for s in range(4)]
    free.append(lambda: complete(client, prompt="Once upon a time", max_tokens=40, seed=1))
    results = concurrently(constrained + free)
    samples = 0
    for r in results[: len(constrained)]:
        for choice in r.choices:
            text = choice.message.content if hasattr(choice, "message") else choice.text
            assert choice.finish_reason == "stop", text
            person_ok(text)
            samples += 1
    assert samples == 10
    free_texts = [
        r.choices[0].message.content if hasattr(r.choices[0], "message") else r.choices[0].text
        for r in results[len(constrained) :]
    ]
    assert any(not t.lstrip().startswith("{") for t in free_texts)  # the free ones were not constrained


def test_json_object_gives_an_object(client):
    r = chat(client, response_format={"type": "json_object"}, seed=2, max_tokens=480)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("seed", range(3))
def test_guided_choice_returns_one_of_the_choices(client, seed):
    r = chat(client, seed=seed, max_tokens=20, extra_body={"guided_choice": CHOICES})
    assert r.choices[0].message.content in CHOICES and r.choices[0].finish_reason == "stop"
    r = complete(
        client, prompt="Colour:", seed=seed, max_tokens=20, extra_body={"structured_outputs": {"choice": CHOICES}}
    )
    assert r.choices[0].text in CHOICES


def test_guided_regex_matches(client):
    pattern = r"[A-Z][a-z]{1,6} (is|was) [0-9]{1,2}\."
    r = chat(client, seed=3, max_tokens=30, n=3, extra_body={"guided_regex": pattern})
    assert all(re.fullmatch(pattern, c.message.content) for c in r.choices)


def test_streaming_equals_non_streaming(client):
    for extra in ({"response_format": PERSON_FORMAT}, {"extra_body": {"guided_choice": CHOICES}}, {}):
        whole = chat(client, seed=11, max_tokens=300, **extra).choices[0].message.content
        chunks = list(chat(client, seed=11, max_tokens=300, stream=True, **extra))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def validate_calls(calls, names=None) -> list[str]:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    if names is not None:
        assert [c.function.name for c in calls] == names
    return [c.function.name for c in calls]


@pytest.mark.parametrize("seed", range(2))
def test_forced_tool_calls_parse_and_validate(client, seed):
    named = chat(
        client,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        seed=seed,
        max_tokens=200,
    )
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    validate_calls(choice.message.tool_calls, ["get_time"])
    required = chat(client, tools=TOOLS, tool_choice="required", seed=seed, max_tokens=450)
    assert required.choices[0].finish_reason == "tool_calls"
    validate_calls(required.choices[0].message.tool_calls)


def streamed_calls(chunks, fragments: list | None = None):
    """Tool-call deltas accumulated the way OpenAI's clients do, checking OpenAI's shape on the way:
    a call's first delta has its id, type and name, the later ones only argument fragments."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta.index not in calls:
                assert delta.index == len(calls) and delta.id.startswith("call_") and delta.type == "function"
                calls[delta.index] = {"name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and delta.function.name is None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
            if fragments is not None:
                fragments.append(delta.function.arguments)
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
LLAMA_CALLS = (
    '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}; '
    '{"name": "get_time", "parameters": {"zone": "utc"}}'
)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tool_choice="required", seed=5, max_tokens=450),
        dict(tool_choice="required", seed=6, max_tokens=450),
        dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}, seed=7, max_tokens=200),
        dict(seed=1, max_tokens=100, extra_body={"guided_regex": re.escape(HERMES_CALL)}),  # auto: Hermes
        dict(seed=1, max_tokens=100, extra_body={"guided_regex": re.escape(LLAMA_CALLS)}),  # auto: Llama 3 JSON
    ],
    ids=["required", "required-2", "named", "hermes", "llama3-json"],
)
def test_tool_calls_stream_as_deltas(client, kwargs):
    """The name first, then the arguments in fragments as the model writes them; joined, exactly the
    non-streamed calls."""
    whole = chat(client, tools=TOOLS, **kwargs).choices[0]
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    validate_calls(whole.message.tool_calls)
    fragments: list[str] = []
    chunks = list(chat(client, tools=TOOLS, stream=True, **kwargs))
    assert streamed_calls(chunks, fragments) == expected
    assert len(fragments) > 2 * len(expected)  # the arguments came in pieces, not whole at the end
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (whole.message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason == "tool_calls"


def test_auto_tool_choice_parses_hermes_calls_from_the_text(client):
    """The model is made to write a Hermes call (a regex forces the text); tool_choice auto parses it."""
    kwargs = dict(tools=TOOLS, seed=1, max_tokens=100, extra_body={"guided_regex": re.escape(HERMES_CALL)})
    message = chat(client, **kwargs).choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"})
    ]
    plain = (
        chat(
            client,
            tools=TOOLS,
            tool_choice="none",
            seed=1,
            max_tokens=100,
            extra_body={"guided_regex": re.escape(HERMES_CALL)},
        )
        .choices[0]
        .message
    )
    assert plain.tool_calls is None and plain.content == HERMES_CALL


def test_tool_results_are_accepted_in_the_conversation(client):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    r = chat(client, messages=messages, tools=TOOLS, max_tokens=5, seed=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


EOS = embedded_tokenizer().eos_token_ids


def test_min_tokens_and_logit_bias_take_effect(client):
    eos = min(EOS)
    r = chat(client, temperature=0, max_tokens=40, logit_bias={str(eos): 100}, extra_body={"min_tokens": 5})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "stop"
    favourite = embedded_tokenizer().encode(" engine", add_special_tokens=False)[0]
    r = complete(client, prompt="Once", temperature=0, max_tokens=6, logit_bias={str(favourite): 100})
    assert r.choices[0].text == " engine" * 6


NEW_FIELDS = [
    dict(presence_penalty=1.5, temperature=0),
    dict(frequency_penalty=2.0, temperature=0),
    dict(frequency_penalty=-1.0, presence_penalty=0.5, seed=3),
    dict(extra_body={"repetition_penalty": 1.3}, temperature=0),
    dict(extra_body={"repetition_penalty": 0.8, "min_p": 0.1}, seed=4),
    dict(extra_body={"min_p": 0.3}, seed=5),
    dict(logit_bias={"10": 5, "20": -100}, seed=6),
    dict(extra_body={"min_tokens": 8, "stop_token_ids": [30, 31]}, seed=7),
    dict(extra_body={"ignore_eos": True}, seed=8),
    dict(response_format=PERSON_FORMAT, seed=9, max_tokens=300),
    dict(extra_body={"guided_choice": CHOICES}, seed=10),
    dict(tools=TOOLS, tool_choice="required", seed=11, max_tokens=300),
    dict(max_completion_tokens=7, seed=12, logprobs=True, top_logprobs=3),
]


def answer(r):
    """What must be identical, and the logprobs (equal to float precision: a batch's matmuls may round
    differently)."""
    choice = r.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    tops = (
        [[(t.token, t.logprob) for t in token.top_logprobs] for token in choice.logprobs.content]
        if choice.logprobs
        else []
    )
    exact = (
        choice.message.content,
        calls,
        choice.finish_reason,
        r.usage.completion_tokens,
        [[token for token, _ in top] for top in tops],
    )
    return exact, [logprob for top in tops for _, logprob in top]


def test_every_new_field_batched_equals_alone(client):
    def call(kwargs):
        kwargs = {"max_tokens": 24, **kwargs}
        return lambda: answer(chat(client, **kwargs))

    alone = [call(kwargs)() for kwargs in NEW_FIELDS]
    batched = concurrently([call(kwargs) for kwargs in NEW_FIELDS])
    assert [exact for exact, _ in batched] == [exact for exact, _ in alone]
    for (_, logprobs), (_, expected) in zip(batched, alone):
        assert logprobs == pytest.approx(expected, abs=1e-3)
    assert alone[0][0] != answer(chat(client, temperature=0, max_tokens=24))[0]  # the penalty changed it


@pytest.mark.parametrize(
    "body, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "sandwich"}}}},
            "sandwich",
        ),
        ({"extra_body": {"guided_regex": "[a-"}}, "unclosed character class"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}}, "one output constraint"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "launch"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_bad_constraints_are_400_naming_the_problem(client, body, words):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=5, **body)
    assert words in info.value.message
    assert chat(client, max_tokens=2).choices  # the server is still up
