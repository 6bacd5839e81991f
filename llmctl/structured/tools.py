"""Tool calling: tools into the chat template, tool calls out of the model's text.

Rendering follows ``transformers``: the OpenAI ``tools`` list is handed to the chat template as its
``tools`` variable, and an assistant message's ``tool_calls[].function.arguments`` (a JSON string in
the OpenAI API) is parsed into a mapping, which is what templates expect (as vLLM does).

Parsing understands the two formats most open models use:

- Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, possibly several,
  after some prose;
- Llama 3 JSON: the whole reply is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``, several separated by ``;``), counted as a call only when the name is a tool.

One incremental parser does both the streaming and the complete reply (the complete reply is the
stream fed at once), so streamed deltas always add up to the non-streaming answer. ``required`` and
named ``tool_choice`` are enforced with the grammar engine instead, as vLLM does: the reply is
constrained to a JSON schema (the function's parameters, or a list of ``{"name", "parameters"}``)
and parsed from that.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from llmctl.errors import InvalidRequestError
from llmctl.structured.spec import StructuredOutputSpec

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


# ---- the request side ---------------------------------------------------------------------------
def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def template_variables(tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Extra chat-template variables for ``Tokenizer.apply_chat_template(..., **extra)``."""
    return {"tools": tools} if tools else {}


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant ``tool_calls`` arguments as mappings (templates ``tojson`` them); everything else as is."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_call_for_template(c) for c in calls]}
        out.append(message)
    return out


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"tool_calls arguments of {function.get('name')!r} are not valid JSON: {exc}") from exc
    return {**call, "function": function}


def forced_tool(tools: list[dict[str, Any]], tool_choice: Any) -> dict[str, Any] | None:
    """The function a named ``tool_choice`` forces; None for "auto"/"none"/"required"."""
    if not isinstance(tool_choice, dict):
        return None
    name = (tool_choice.get("function") or {}).get("name")
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool["function"]
    raise InvalidRequestError(f"tool_choice names function {name!r}, which is not among the tools "
                              f"({', '.join(tool_names(tools)) or 'none given'})")


def tool_choice_spec(tools: list[dict[str, Any]], tool_choice: Any) -> StructuredOutputSpec | None:
    """The grammar a ``required`` or named ``tool_choice`` imposes on the reply; None otherwise."""
    function = forced_tool(tools, tool_choice)
    if function is not None:
        return StructuredOutputSpec.json_schema(function.get("parameters") or EMPTY_PARAMETERS)
    if tool_choice != "required":
        return None
    one_call = [{"type": "object",
                 "properties": {"name": {"enum": [t["function"]["name"]]},
                                "parameters": t["function"].get("parameters") or EMPTY_PARAMETERS},
                 "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return StructuredOutputSpec.json_schema({"type": "array", "minItems": 1, "items": {"anyOf": one_call}})


# ---- the response side --------------------------------------------------------------------------
def new_call(name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` entry; ``arguments`` is re-serialised as the JSON string OpenAI sends."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _call_from_json(data: Any, names: set[str] | None) -> dict[str, Any] | None:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    if names is not None and data["name"] not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return new_call(data["name"], arguments) if isinstance(arguments, dict) else None


def _json_calls(text: str, names: set[str]) -> list[dict[str, Any]] | None:
    """Llama 3 JSON: the whole text is one or more ``;``-separated call objects, else None."""
    body = text.strip()
    body = body[len(PYTHON_TAG):].lstrip() if body.startswith(PYTHON_TAG) else body
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            data, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return None
        call = _call_from_json(data, names)
        if call is None:
            return None
        calls.append(call)
        rest = body[pos:].lstrip()
        if rest and not rest.startswith(";"):
            return None
        pos = len(body) - len(rest.lstrip(";").lstrip())
    return calls or None


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallParser:
    """Feeds on the reply's text deltas; returns what is certainly content and which calls completed.

    In Hermes mode prose streams at once, except a tail that might open ``<tool_call>`` (and the
    whitespace before it); each call is sent when its closing tag arrives. A reply that starts like
    JSON is held to the end and then judged whole (Llama 3 calls, or plain content)."""

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.names = set(tool_names(tools))
        self.buffer = ""  # text received but not yet given out
        self.mode = "undecided"  # -> "json" (held to the end) or "text"
        self.in_call = False
        self.after_call = False
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self.buffer += text
        out = ParsedDelta()
        if self.mode == "undecided":
            head = self.buffer.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return out
            self.mode = "json" if head.startswith(("{", PYTHON_TAG)) else "text"
        if self.mode == "text":
            self._drain_text(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.mode != "text":
            calls = _json_calls(self.buffer, self.names)
            if calls is not None:
                out.tool_calls = self._number(calls)
            else:
                out.content, self.buffer = self.buffer, ""
            self.buffer = ""
            return out
        self._drain_text(out, final=True)
        return out

    def _drain_text(self, out: ParsedDelta, final: bool) -> None:
        while self.buffer:
            if self.in_call:
                end = self.buffer.find(HERMES_CLOSE)
                if end < 0 and not final:
                    return
                block = self.buffer if end < 0 else self.buffer[: end + len(HERMES_CLOSE)]
                self.buffer = "" if end < 0 else self.buffer[end + len(HERMES_CLOSE):]
                self.in_call = False
                self._emit_block(block, out)
                self.after_call = True
                continue
            start = self.buffer.find(HERMES_OPEN)
            if start >= 0:
                self._emit_prose(self.buffer[:start].rstrip(), out)  # the layout before a call is not content
                self.buffer = self.buffer[start:]
                self.in_call = True
                continue
            if final:
                text = self.buffer.rstrip() if self.num_calls else self.buffer
                self.buffer = ""
            else:  # hold back what may yet be the whitespace before, or the start of, "<tool_call>"
                keep = _held_tail(self.buffer)
                text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
            self._emit_prose(text, out)
            return

    def _emit_prose(self, text: str, out: ParsedDelta) -> None:
        if self.after_call:  # the line break after a call is layout, not content
            text = text.lstrip()
            self.after_call = not text
        out.content += text

    def _emit_block(self, block: str, out: ParsedDelta) -> None:
        inner = block[len(HERMES_OPEN):]
        inner = inner[: -len(HERMES_CLOSE)] if inner.endswith(HERMES_CLOSE) else inner
        try:
            call = _call_from_json(json.loads(inner), None)
        except json.JSONDecodeError:
            call = None
        if call is None:
            out.content += block  # not a call after all: keep the text
        else:
            out.tool_calls += self._number([call])

    def _number(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        numbered = []
        for call in calls:
            numbered.append({"index": self.num_calls, **call})
            self.num_calls += 1
        return numbered


def _held_tail(text: str) -> int:
    """How many trailing characters could still turn out to be whitespace before ``<tool_call>``."""
    for size in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-size:]):
            return size + (len(text[:-size]) - len(text[:-size].rstrip()))
    return len(text) - len(text.rstrip())


def parse_tool_calls(text: str, tools: list[dict[str, Any]]) -> ParsedDelta:
    """The complete reply's content and tool calls (``index`` keys dropped, as in a message)."""
    parser = ToolCallParser(tools)
    first, last = parser.feed(text), parser.finish()
    calls = [{k: v for k, v in c.items() if k != "index"} for c in first.tool_calls + last.tool_calls]
    return ParsedDelta(first.content + last.content, calls)


def parse_forced_calls(text: str, tools: list[dict[str, Any]], tool_choice: Any) -> list[dict[str, Any]]:
    """Tool calls from a reply constrained by ``tool_choice_spec`` (empty if it was cut short)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return []
    function = forced_tool(tools, tool_choice)
    if function is not None:
        return [new_call(function["name"], data)] if isinstance(data, dict) else []
    calls = [_call_from_json(item, set(tool_names(tools))) for item in data] if isinstance(data, list) else []
    return [c for c in calls if c is not None]


class ReplyParser:
    """What the chat endpoint does with one choice's text when tools are offered: ``auto`` parses
    calls out of the text as it streams; ``required``/named choice (the text is the constrained
    JSON) parses it at the end. Fed deltas, or the whole reply at once; both give the same result."""

    def __init__(self, tools: list[dict[str, Any]], tool_choice: Any) -> None:
        self.tools, self.tool_choice = tools, tool_choice
        self.forced = tool_choice == "required" or isinstance(tool_choice, dict)
        self.auto = None if self.forced else ToolCallParser(tools)
        self.held = ""

    def feed(self, text: str) -> ParsedDelta:
        if self.auto is not None:
            return self.auto.feed(text)
        self.held += text
        return ParsedDelta()

    def finish(self) -> ParsedDelta:
        if self.auto is not None:
            return self.auto.finish()
        calls = parse_forced_calls(self.held, self.tools, self.tool_choice)
        if not calls:  # cut short (max_tokens): the text is all there is
            return ParsedDelta(self.held)
        return ParsedDelta("", [{"index": i, **call} for i, call in enumerate(calls)])


def reply_parser(tools: list[dict[str, Any]] | None, tool_choice: Any) -> ReplyParser | None:
    """None when the reply is plain content: no tools, or ``tool_choice`` "none"."""
    return ReplyParser(tools, tool_choice) if tools and tool_choice != "none" else None
