"""Tool calling helpers: rendering tools into a chat template, parsing Hermes/Qwen and Llama 3 JSON
tool calls (streamed deltas, arguments in fragments as they are written, add up to the complete
parse), and forced tool choice via the grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_structured import random_walk

from llmctl.errors import InvalidRequestError
from llmctl.models.embedded import embedded_tokenizer
from llmctl.structured import StructuredOutputManager
from llmctl.structured.tool_calls import ToolCallParser, merge_calls, parse_tool_calls, reply_parser
from llmctl.structured.tools import messages_for_template, template_variables, tool_choice_spec
from llmctl.tokenizer import Tokenizer

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
TIME = {
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
TOOLS = [WEATHER, TIME]

# a Hermes-style template in the shape of Qwen2.5's: tools as JSON lines, calls as <tool_call> JSON
HERMES_TEMPLATE = (
    """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}"""
    """{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
)


def call_summary(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


REPLIES = [
    # (text, expected content, expected calls)
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
        "\n</tool_call>",
        "Let me check.",
        [("get_weather", {"city": "Paris", "unit": "c"})],
    ),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Oslo", "unit": "f"}), ("get_time", {"zone": "cet"})],
    ),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}', "", [("get_time", {"zone": "utc"})]),  # unclosed
    ('Hmm <tool_call>{"name": broken}</tool_call> ok', 'Hmm<tool_call>{"name": broken}</tool_call>ok', []),
    (
        '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}',
        "",
        [("get_weather", {"city": "Rome", "unit": "c"})],
    ),
    (
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "utc"}}; '
        '{"name": "get_time", "parameters": {"zone": "cet"}}',
        "",
        [("get_time", {"zone": "utc"}), ("get_time", {"zone": "cet"})],
    ),
    ('{"name": "send_email", "parameters": {}}', '{"name": "send_email", "parameters": {}}', []),  # not a tool
    ('{"answer": 42}\n', '{"answer": 42}\n', []),
    (
        "Just prose, with <b>tags</b> and a trailing space <tool ",
        "Just prose, with <b>tags</b> and a trailing space <tool ",
        [],
    ),
    ("  \n", "  \n", []),
    ('Hi <tool_call>{"name": "get_ti', 'Hi<tool_call>{"name": "get_ti', []),  # a head cut short stays text
    (
        '{"name": "get_time", "parameters": {"zone": "utc"}}; {"name": "get_',
        '{"name": "get_',
        [("get_time", {"zone": "utc"})],
    ),
]


@pytest.mark.parametrize("text, content, calls", REPLIES)
def test_parse_complete_reply(text, content, calls):
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.content == content
    assert call_summary(parsed.tool_calls) == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in parsed.tool_calls)


def stream(parser, text: str, chunk: int):
    return [parser.feed(text[i : i + chunk]) for i in range(0, len(text), chunk)] + [parser.finish()]


def check_deltas(deltas) -> list[dict]:
    """OpenAI's streaming shape: a call's first delta has its id, type and name, the later ones only
    arguments; indexes count up from 0. The calls, merged."""
    started: list[int] = []
    for delta in (d for part in deltas for d in part.tool_calls):
        if "id" in delta:
            assert delta["index"] == len(started) and delta["type"] == "function" and delta["function"]["name"]
            started.append(delta["index"])
        else:
            assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            assert started and delta["index"] == started[-1]
    return merge_calls([d for part in deltas for d in part.tool_calls])


@pytest.mark.parametrize("text", [r[0] for r in REPLIES])
@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_streamed_deltas_add_up_to_the_complete_parse(text, chunk):
    deltas = stream(ToolCallParser(TOOLS), text, chunk)
    whole = parse_tool_calls(text, TOOLS)
    assert "".join(d.content for d in deltas) == whole.content
    streamed = check_deltas(deltas)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls
    ]


def test_prose_streams_before_the_end():
    """Content is not held back longer than a possible '<tool_call>' prefix."""
    parser = ToolCallParser(TOOLS)
    assert parser.feed("Hello the").content == "Hello the"
    assert parser.feed("re <tool").content == "re"
    delta = parser.feed('_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>')
    assert delta.content == "" and call_summary(merge_calls(delta.tool_calls)) == [("get_time", {"zone": "utc"})]


@pytest.mark.parametrize(
    "tool_choice, text",
    [
        ("auto", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'),
        ("auto", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}'),
        ("required", '[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}]'),
        ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Oslo", "unit": "c"}'),
    ],
)
def test_arguments_stream_as_they_are_written(tool_choice, text):
    """The name goes out as soon as it is read; the arguments follow in fragments, each as soon as
    its characters arrive, before the call's object (or tag) closes."""
    parser = reply_parser(TOOLS, tool_choice)
    deltas = stream(parser, text, 1)
    first = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert deltas[first].tool_calls[0]["function"]["name"] == "get_weather"
    assert text.index('"city"') > first  # the name went out before the arguments were written
    fragments = [d.tool_calls[0]["function"]["arguments"] for d in deltas[first:] if d.tool_calls]
    assert "".join(fragments) == '{"city": "Oslo", "unit": "c"}'
    assert len(fragments) == len('{"city": "Oslo", "unit": "c"}')  # one per character fed
    assert not "".join(d.content for d in deltas)


@pytest.mark.parametrize(
    "tool_choice, text, arguments",
    [
        ("auto", '<tool_call>{"name": "get_time", "arguments": {"zone": "u', '{"zone": "u'),
        ("required", '[{"name": "get_time", "parameters": {"zo', '{"zo'),
        ({"type": "function", "function": {"name": "get_time"}}, ' {"zone": ', '{"zone": '),
    ],
)
def test_a_call_cut_short_keeps_the_arguments_written(tool_choice, text, arguments):
    """As OpenAI's calls cut by max_tokens (finish_reason "length"): the arguments so far."""
    for chunk in (1, 4, len(text)):
        calls = check_deltas(stream(reply_parser(TOOLS, tool_choice), text, chunk))
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("get_time", arguments)]


def test_a_call_in_another_key_order_is_judged_whole():
    text = '<tool_call>{"arguments": {"zone": "cet"}, "name": "get_time"}</tool_call> done'
    for chunk in (1, 5):
        deltas = stream(ToolCallParser(TOOLS), text, chunk)
        assert call_summary(check_deltas(deltas)) == [("get_time", {"zone": "cet"})]
        assert "".join(d.content for d in deltas) == "done"


def test_tools_rendered_through_the_chat_template():
    base = embedded_tokenizer()
    tokenizer = Tokenizer(base.backend, {**base.config, "chat_template": HERMES_TEMPLATE})
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    prompt = tokenizer.apply_chat_template(messages_for_template(messages), **template_variables(TOOLS))
    assert json.dumps(WEATHER, ensure_ascii=False) in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in prompt  # not a quoted string
    assert "<|im_start|>tool\n21 C<|im_end|>" in prompt
    assert template_variables(None) == {} and template_variables([]) == {}


def test_bad_arguments_in_history_name_the_call():
    with pytest.raises(InvalidRequestError, match="get_weather"):
        messages_for_template(
            [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}
                    ],
                }
            ]
        )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_gives_valid_calls_from_random_logits(tool_choice, seed):
    tokenizer = embedded_tokenizer()
    manager = StructuredOutputManager.for_tokenizer(tokenizer)
    spec = tool_choice_spec(TOOLS, tool_choice)
    tokens, ended = random_walk(manager, tokenizer, spec, seed, max_steps=2000)
    assert ended
    calls = parse_tool_calls(tokenizer.decode(tokens), TOOLS, tool_choice).tool_calls
    assert calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, arguments in call_summary(calls):
        jsonschema.validate(arguments, schemas[name])
    if isinstance(tool_choice, dict):
        assert [name for name, _ in call_summary(calls)] == ["get_weather"]


def test_auto_and_none_impose_no_grammar_and_unknown_names_are_refused():
    assert tool_choice_spec(TOOLS, "auto") is None and tool_choice_spec(TOOLS, "none") is None
    with pytest.raises(InvalidRequestError, match="send_email.*get_weather, get_time"):
        tool_choice_spec(TOOLS, {"type": "function", "function": {"name": "send_email"}})
    assert parse_tool_calls('{"city": "Par', TOOLS, "required").tool_calls == []  # not the list required writes


@pytest.mark.parametrize(
    "tool_choice, text, content, calls",
    [
        (
            "auto",
            'Hi <tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>',
            "Hi",
            [("get_time", {"zone": "utc"})],
        ),
        ("required", '[{"name": "get_time", "parameters": {"zone": "cet"}}]', "", [("get_time", {"zone": "cet"})]),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            '{"city": "Rome", "unit": "f"}',
            "",
            [("get_weather", {"city": "Rome", "unit": "f"})],
        ),
        ("required", '[{"name": "get_time", "param', '[{"name": "get_time", "param', []),  # cut before a name: text
    ],
)
def test_reply_parser_streams_and_whole_agree(tool_choice, text, content, calls):
    assert reply_parser(TOOLS, "none") is None and reply_parser(None, "auto") is None
    whole = reply_parser(TOOLS, tool_choice).whole(text)
    deltas = stream(reply_parser(TOOLS, tool_choice), text, 3)
    assert whole.content == "".join(d.content for d in deltas) == content
    assert call_summary(whole.tool_calls) == call_summary(check_deltas(deltas)) == calls
