"""Tool calls out of the model's text, streamed as OpenAI streams them.

Formats understood:

- Hermes / Qwen (``tool_choice`` auto): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  possibly several, after some prose;
- Llama 3 JSON (auto): the reply is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``, several separated by ``;``), counted as a call only when the name is a tool;
- ``required``: the grammar-constrained list ``[{"name": ..., "parameters": {...}}, ...]``;
- a named function: the grammar-constrained reply is that function's arguments object.

Streaming follows OpenAI: a call's first delta carries its ``index``, ``id``, ``type`` and
``function.name`` (arguments ``""``) as soon as the name is read; ``function.arguments`` then
streams in fragments as the model writes them (the model's own JSON text), until the object closes.
A call is recognised by its head, ``{"name": "<name>", "arguments": {`` (or ``"parameters"``); a
block that does not start like that (another key order, arguments as a JSON string) is held until
it is complete and judged whole (its arguments re-serialised). A call cut short by ``max_tokens``
keeps the arguments written so far, as OpenAI's do.

The complete (non-streamed) reply is the same parser fed the whole text, its deltas merged
(``merge_calls``), so streamed and non-streamed answers agree exactly.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
ANY_KEY = ("arguments", "parameters")


@dataclass
class ParsedDelta:
    """What one piece of text gave: content, and tool-call deltas in OpenAI's streaming shape."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def merge_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call deltas joined into complete ``tool_calls`` entries (as a client joins a stream)."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.get(delta["index"])
        if call is None:
            calls[delta["index"]] = {
                "id": delta["id"],
                "type": delta["type"],
                "function": {"name": delta["function"]["name"], "arguments": delta["function"]["arguments"]},
            }
        else:
            call["function"]["arguments"] += delta["function"]["arguments"]
    return [calls[index] for index in sorted(calls)]


# ---- reading one call object as it streams ---------------------------------------------------------
PARTIAL, FAILED = "partial", "failed"


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _string_end(text: str, pos: int) -> int:
    """The index after the JSON string starting at ``text[pos]`` (a quote); -1 if it is not closed yet."""
    escaped = False
    for i in range(pos + 1, len(text)):
        if escaped:
            escaped = False
        elif text[i] == "\\":
            escaped = True
        elif text[i] == '"':
            return i + 1
    return -1


def _read_head(text: str, keys: tuple[str, ...]) -> tuple[str, int] | str:
    """``(name, index of the arguments' "{")`` when ``text`` starts with ``{"name": "<name>", "<key>": {``;
    PARTIAL while it may still; FAILED once it cannot."""
    pos, name = 0, None
    for step in ("{", '"name"', ":", None, ",", keys, ":"):
        pos = _skip_ws(text, pos)
        if pos == len(text):
            return PARTIAL
        if step is None:  # the name, a JSON string
            if text[pos] != '"':
                return FAILED
            end = _string_end(text, pos)
            if end < 0:
                return PARTIAL
            try:
                name = json.loads(text[pos:end])
            except json.JSONDecodeError:
                return FAILED
            pos = end
            continue
        options = [f'"{k}"' for k in step] if isinstance(step, tuple) else [step]
        matched = next((o for o in options if text.startswith(o, pos)), None)
        if matched is None:
            rest = text[pos:]
            return PARTIAL if any(len(rest) < len(o) and o.startswith(rest) for o in options) else FAILED
        pos += len(matched)
    pos = _skip_ws(text, pos)
    if pos == len(text):
        return PARTIAL
    return (name, pos) if text[pos] == "{" and isinstance(name, str) else FAILED


class _CallObject:
    """One call object, fed as it streams: its head (the name), then its arguments, passed on as
    they come, then the object's end. ``failed`` when it turns out not to be a call in the
    streamable shape; ``text`` then holds everything it was fed."""

    def __init__(self, keys: tuple[str, ...], names: set[str] | None) -> None:
        self.keys, self.names = keys, names
        self.text = ""
        self.name: str | None = None
        self.failed = False
        self._depth = 1  # inside the call object once the head is read
        self._in_string = self._escaped = False
        self._in_arguments = True

    def feed(self, text: str) -> tuple[str | None, str, str | None]:
        """``(name if the head was read just now, argument text, what followed the object's end)``."""
        if self.name is not None:
            return (None, *self._scan(text))
        self.text += text
        head = _read_head(self.text, self.keys)
        if head == PARTIAL:
            return None, "", None
        if head == FAILED or (self.names is not None and head[0] not in self.names):
            self.failed = True
            return None, "", None
        self.name, start = head
        return (self.name, *self._scan(self.text[start:]))

    def _scan(self, text: str) -> tuple[str, str | None]:
        arguments: list[str] = []
        for i, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
            elif char == "<":  # never outside a JSON string: the object was cut short (a tag follows)
                return "".join(arguments), text[i:]
            if self._in_arguments:
                arguments.append(char)
                self._in_arguments = self._depth > 1 or self._in_string
            if self._depth <= 0:
                return "".join(arguments), text[i + 1 :]
        return "".join(arguments), None


def _call_from_json(data: Any, names: set[str] | None) -> tuple[str, str] | None:
    """``(name, arguments as a JSON string)`` of a call object judged whole; None if it is none."""
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
    return (data["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None


class _Calls:
    """Numbers the calls of one reply and writes their deltas."""

    def __init__(self) -> None:
        self.num_calls = 0

    def _emit(self, out: ParsedDelta, name: str | None, arguments: str) -> None:
        """A new call (``name`` given) or more arguments for the current one; fragments of one call
        within one delta are joined."""
        if name is not None:
            out.tool_calls.append(
                {
                    "index": self.num_calls,
                    "id": new_call_id(),
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
            self.num_calls += 1
        elif arguments:
            last = out.tool_calls[-1] if out.tool_calls else None
            if last is not None and last["index"] == self.num_calls - 1:
                last["function"]["arguments"] += arguments
            else:
                out.tool_calls.append({"index": self.num_calls - 1, "function": {"arguments": arguments}})

    def _feed_object(self, call: _CallObject, text: str, out: ParsedDelta) -> str | None:
        """Feed ``call``; what followed its end (None while it goes on or once it failed)."""
        name, arguments, rest = call.feed(text)
        if name is not None or arguments:
            self._emit(out, name, arguments)
        return rest


class CallList(_Calls):
    """A reply that is a list of call objects: Llama 3 JSON (``;`` between calls, an optional
    ``<|python_tag|>``, names must be tools) or ``required``'s ``[call, ...]``. A first object that
    is not streamable is held and the whole reply judged at the end; text after the calls that is
    not one is content."""

    def __init__(self, names: set[str], keys: tuple[str, ...], bracketed: bool) -> None:
        super().__init__()
        self.names, self.keys, self.bracketed = names, keys, bracketed
        self.raw = ""  # everything fed: a reply judged whole needs it
        self.buffer = ""
        self.call: _CallObject | None = None
        # "open" (before "[" or the tag), "next" (a call may start), "object" (a call streams),
        # "between" (after a call: a separator), "held" (judged whole at the end), "content"
        self.state = "open"

    def feed(self, text: str) -> ParsedDelta:
        self.raw += text
        self.buffer += text
        out = ParsedDelta()
        while self.buffer and self._step(out):
            pass
        return out

    def _step(self, out: ParsedDelta) -> bool:
        """Consume what can be consumed of the buffer; False to wait for more text."""
        if self.state == "content":
            out.content += self.buffer
            self.buffer = ""
        if self.state in ("held", "content"):
            return False
        if self.state == "object":
            assert self.call is not None
            text, self.buffer = self.buffer, ""
            rest = self._feed_object(self.call, text, out)
            if self.call.failed:
                self._give_up(self.call.text)
            elif rest is not None:
                self.state, self.buffer = "between", rest
            return bool(self.buffer)
        head = self.buffer.lstrip()
        self.buffer = head
        if not head:
            return False
        if self.bracketed and self.state != "open" and head[0] == "]":
            self.state, self.buffer = "content", head[1:].lstrip()
            return True
        if self.state in ("open", "between"):
            mark = ("[" if self.bracketed else PYTHON_TAG) if self.state == "open" else ("," if self.bracketed else ";")
            if head.startswith(mark):
                self.state, self.buffer = "next", head[len(mark) :]
                return True
            if mark.startswith(head):
                return False  # may be the mark, cut
            if self.bracketed:
                self._give_up(head)
                return True
            self.state = "next"  # Llama 3's tag and separators are optional
        if head[0] == "{":
            self.state, self.call = "object", _CallObject(self.keys, self.names)
            return True
        self._give_up(head)
        return True

    def _give_up(self, text: str) -> None:
        """Not a call: the reply is judged whole at the end if no call came before, else content."""
        self.state, self.buffer = ("held" if self.num_calls == 0 else "content"), text

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.num_calls == 0:
            whole = None if self.bracketed else _json_calls(self.raw, self.names)
            if whole is None:
                out.content = self.raw
            for name, arguments in whole or []:
                self._emit(out, name, arguments)
        elif self.state == "object" and self.call is not None and self.call.name is None:  # a head cut short
            out.content = self.call.text
        elif self.state != "object" and self.buffer.strip(" \t\r\n;,"):
            out.content = self.buffer
        self.buffer = ""
        return out


def _json_calls(text: str, names: set[str]) -> list[tuple[str, str]] | None:
    """Llama 3 JSON judged whole: the text is one or more ``;``-separated call objects, else None."""
    body = text.strip()
    body = body[len(PYTHON_TAG) :].lstrip() if body.startswith(PYTHON_TAG) else body
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


class NamedCall(_Calls):
    """A named ``tool_choice``: the (constrained) reply is the function's arguments object."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self.num_calls == 0:
            text = text.lstrip()
            if not text:
                return out
        self._emit(out, self.name if self.num_calls == 0 else None, text)
        return out

    def finish(self) -> ParsedDelta:
        return ParsedDelta()


class ToolCallParser(_Calls):
    """``tool_choice`` auto. Prose streams at once, except a tail that might open ``<tool_call>``
    (and the whitespace before it); a Hermes call streams from its head on. A reply that starts
    like JSON (or ``<|python_tag|>``) is Llama 3's format, read by a ``CallList``."""

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__()
        self.names = {t["function"]["name"] for t in tools}
        self.buffer = ""  # text received but not yet given out
        self.llama: CallList | None = None
        self.mode = "undecided"  # -> "llama" or "text"
        self.state = "prose"  # text mode: "prose", "object" (a call streams), "held" (judged whole), "closing"
        self.call: _CallObject | None = None
        self.after_call = False

    def feed(self, text: str) -> ParsedDelta:
        if self.llama is not None:
            return self.llama.feed(text)
        self.buffer += text
        out = ParsedDelta()
        if self.mode == "undecided":
            head = self.buffer.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return out
            if head.startswith(("{", PYTHON_TAG)):
                self.mode, self.llama, self.buffer = "llama", CallList(self.names, ANY_KEY, bracketed=False), ""
                return self.llama.feed(head)
            self.mode = "text"
        self._drain(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        if self.llama is not None:
            return self.llama.finish()
        if self.state == "object" and self.call is not None and self.call.name is None:  # a head cut short
            self.state, self.buffer = "held", HERMES_OPEN + self.call.text + self.buffer
        out = ParsedDelta()
        self._drain(out, final=True)
        return out

    def _drain(self, out: ParsedDelta, final: bool) -> None:
        while self.buffer:
            if self.state == "object":
                assert self.call is not None
                text, self.buffer = self.buffer, ""
                rest = self._feed_object(self.call, text, out)
                if self.call.failed:
                    self.state, self.buffer = "held", HERMES_OPEN + self.call.text
                elif rest is not None:
                    self.state, self.buffer = "closing", rest
                continue
            if self.state == "held":
                end = self.buffer.find(HERMES_CLOSE)
                if end < 0 and not final:
                    return
                block = self.buffer if end < 0 else self.buffer[: end + len(HERMES_CLOSE)]
                self.buffer = "" if end < 0 else self.buffer[end + len(HERMES_CLOSE) :]
                self._emit_block(block, out)
                self.state, self.after_call = "prose", True
                continue
            if self.state == "closing":  # after a call's object: its closing tag, normally
                head = self.buffer.lstrip()
                if head.startswith(HERMES_CLOSE):
                    self.buffer, self.state, self.after_call = head[len(HERMES_CLOSE) :], "prose", True
                    continue
                if HERMES_CLOSE.startswith(head) and not final:
                    return
                self.state, self.after_call = "prose", True  # no closing tag: the rest is prose
                continue
            start = self.buffer.find(HERMES_OPEN)
            if start >= 0:
                self._emit_prose(self.buffer[:start].rstrip(), out)  # the layout before a call is not content
                self.buffer = self.buffer[start + len(HERMES_OPEN) :]
                self.state, self.call = "object", _CallObject(ANY_KEY, None)
                continue
            if final:
                text = self.buffer.rstrip() if self.num_calls else self.buffer
                self.buffer = ""
            else:  # hold back what may yet be the whitespace before, or the start of, "<tool_call>"
                keep = _held_tail(self.buffer)
                text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
            self._emit_prose(text, out)
            return

    def _emit_prose(self, text: str, out: ParsedDelta) -> None:
        if self.after_call:  # the line break after a call is layout, not content
            text = text.lstrip()
            self.after_call = not text
        out.content += text

    def _emit_block(self, block: str, out: ParsedDelta) -> None:
        inner = block[len(HERMES_OPEN) :]
        inner = inner[: -len(HERMES_CLOSE)] if inner.endswith(HERMES_CLOSE) else inner
        try:
            call = _call_from_json(json.loads(inner), None)
        except json.JSONDecodeError:
            call = None
        if call is None:
            out.content += block  # not a call after all: keep the text
        else:
            self._emit(out, *call)


def _held_tail(text: str) -> int:
    """How many trailing characters could still turn out to be whitespace before ``<tool_call>``."""
    for size in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-size:]):
            return size + (len(text[:-size]) - len(text[:-size].rstrip()))
    return len(text) - len(text.rstrip())


class ReplyParser:
    """What the chat endpoint does with one choice's text when tools are offered: ``auto`` parses
    calls out of the text; ``required`` / a named function read the constrained JSON. Fed deltas,
    or the whole reply at once; both give the same result."""

    def __init__(self, tools: list[dict[str, Any]], tool_choice: Any) -> None:
        names = {t["function"]["name"] for t in tools}
        if isinstance(tool_choice, dict):
            self.reader: ToolCallParser | CallList | NamedCall = NamedCall(tool_choice["function"]["name"])
        elif tool_choice == "required":
            self.reader = CallList(names, ("parameters",), bracketed=True)
        else:
            self.reader = ToolCallParser(tools)

    def feed(self, text: str) -> ParsedDelta:
        return self.reader.feed(text)

    def finish(self) -> ParsedDelta:
        return self.reader.finish()

    def whole(self, text: str) -> ParsedDelta:
        """The complete reply: content, and complete ``tool_calls`` (no ``index``)."""
        first, last = self.feed(text), self.finish()
        return ParsedDelta(first.content + last.content, merge_calls(first.tool_calls + last.tool_calls))


def reply_parser(tools: list[dict[str, Any]] | None, tool_choice: Any) -> ReplyParser | None:
    """None when the reply is plain content: no tools, or ``tool_choice`` "none"."""
    return ReplyParser(tools, tool_choice) if tools and tool_choice != "none" else None


def parse_tool_calls(text: str, tools: list[dict[str, Any]], tool_choice: Any = "auto") -> ParsedDelta:
    """The complete reply's content and tool calls."""
    return ReplyParser(tools, tool_choice).whole(text)
