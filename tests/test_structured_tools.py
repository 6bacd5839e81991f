"""Tool calling helpers: rendering tools into a chat template, parsing Hermes/Qwen and Llama 3 JSON
tool calls (streamed deltas add up to the complete parse), and forced tool choice via the grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest

from llmctl.errors import InvalidRequestError
from llmctl.models.embedded import embedded_tokenizer
from llmctl.structured import StructuredOutputManager
from llmctl.structured.tools import (ToolCallParser, messages_for_template, parse_forced_calls, parse_tool_calls,
                                     template_variables, tool_choice_spec)
from llmctl.tokenizer import Tokenizer
from test_structured import random_walk

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]

# a Hermes-style template in the shape of Qwen2.5's: tools as JSON lines, calls as <tool_call> JSON
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def call_summary(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


REPLIES = [
    # (text, expected content, expected calls)
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris", "unit": "c"})]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>',
     "", [("get_weather", {"city": "Oslo", "unit": "f"}), ("get_time", {"zone": "cet"})]),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}', "", [("get_time", {"zone": "utc"})]),  # unclosed
    ('Hmm <tool_call>{"name": broken}</tool_call> ok', 'Hmm<tool_call>{"name": broken}</tool_call>ok', []),
    ('{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}', "", [("get_weather", {"city": "Rome", "unit": "c"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "utc"}}; {"name": "get_time", "parameters": {"zone": "cet"}}',
     "", [("get_time", {"zone": "utc"}), ("get_time", {"zone": "cet"})]),
    ('{"name": "send_email", "parameters": {}}', '{"name": "send_email", "parameters": {}}', []),  # not a tool
    ('{"answer": 42}\n', '{"answer": 42}\n', []),
    ("Just prose, with <b>tags</b> and a trailing space <tool ", "Just prose, with <b>tags</b> and a trailing space <tool ", []),
    ("  \n", "  \n", []),
]


@pytest.mark.parametrize("text, content, calls", REPLIES)
def test_parse_complete_reply(text, content, calls):
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.content == content
    assert call_summary(parsed.tool_calls) == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in parsed.tool_calls)


@pytest.mark.parametrize("text", [r[0] for r in REPLIES])
@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_streamed_deltas_add_up_to_the_complete_parse(text, chunk):
    parser = ToolCallParser(TOOLS)
    deltas = [parser.feed(text[i : i + chunk]) for i in range(0, len(text), chunk)] + [parser.finish()]
    whole = parse_tool_calls(text, TOOLS)
    assert "".join(d.content for d in deltas) == whole.content
    streamed = [c for d in deltas for c in d.tool_calls]
    assert [c["index"] for c in streamed] == list(range(len(streamed)))
    assert call_summary(streamed) == call_summary(whole.tool_calls)


def test_prose_streams_before_the_end():
    """Content is not held back longer than a possible '<tool_call>' prefix."""
    parser = ToolCallParser(TOOLS)
    assert parser.feed("Hello the").content == "Hello the"
    assert parser.feed("re <tool").content == "re"
    delta = parser.feed('_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>')
    assert delta.content == "" and call_summary(delta.tool_calls) == [("get_time", {"zone": "utc"})]


def test_tools_rendered_through_the_chat_template():
    base = embedded_tokenizer()
    tokenizer = Tokenizer(base.backend, {**base.config, "chat_template": HERMES_TEMPLATE})
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    prompt = tokenizer.apply_chat_template(messages_for_template(messages), **template_variables(TOOLS))
    assert json.dumps(WEATHER, ensure_ascii=False) in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in prompt  # not a quoted string
    assert "<|im_start|>tool\n21 C<|im_end|>" in prompt
    assert template_variables(None) == {} and template_variables([]) == {}


def test_bad_arguments_in_history_name_the_call():
    with pytest.raises(InvalidRequestError, match="get_weather"):
        messages_for_template([{"role": "assistant", "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_gives_valid_calls_from_random_logits(tool_choice, seed):
    tokenizer = embedded_tokenizer()
    manager = StructuredOutputManager.for_tokenizer(tokenizer)
    spec = tool_choice_spec(TOOLS, tool_choice)
    tokens, ended = random_walk(manager, tokenizer, spec, seed, max_steps=2000)
    assert ended
    calls = parse_forced_calls(tokenizer.decode(tokens), TOOLS, tool_choice)
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
    assert parse_forced_calls('{"city": "Par', TOOLS, "required") == []  # cut short by max_tokens


@pytest.mark.parametrize("tool_choice, text, content, calls", [
    ("auto", 'Hi <tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>', "Hi",
     [("get_time", {"zone": "utc"})]),
    ("required", '[{"name": "get_time", "parameters": {"zone": "cet"}}]', "", [("get_time", {"zone": "cet"})]),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Rome", "unit": "f"}', "",
     [("get_weather", {"city": "Rome", "unit": "f"})]),
    ("required", '[{"name": "get_time", "param', '[{"name": "get_time", "param', []),  # cut short: kept as text
])
def test_reply_parser_streams_and_whole_agree(tool_choice, text, content, calls):
    from llmctl.structured.tools import reply_parser

    assert reply_parser(TOOLS, "none") is None and reply_parser(None, "auto") is None
    whole = reply_parser(TOOLS, tool_choice)
    first, last = whole.feed(text), whole.finish()
    streamed = reply_parser(TOOLS, tool_choice)
    deltas = [streamed.feed(text[i : i + 3]) for i in range(0, len(text), 3)] + [streamed.finish()]
    for parts in ([first, last], deltas):
        assert "".join(d.content for d in parts) == content
        assert call_summary([c for d in parts for c in d.tool_calls]) == calls
