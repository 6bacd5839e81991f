"""OpenAI's Responses API: ``POST /v1/responses``, without server-side state.

``input`` (a string, or a list of messages, ``function_call``, ``function_call_output`` and
``reasoning`` items) and ``instructions`` become a chat request; ``max_output_tokens``,
``temperature``, ``top_p``, ``text.format`` (structured outputs), function ``tools``,
``tool_choice``, ``reasoning.effort`` (the template's ``reasoning_effort``) and ``user`` map onto its
fields; ``model`` may name a LoRA adapter, which the chat path runs
(``OpenAIServing.generation_target``) as for ``/v1/chat/completions``. The answer's ``output``
holds a ``reasoning`` item (with a reasoning parser), a ``message`` with ``output_text`` and
``function_call`` items; streamed, the Responses events from
``response.created`` to ``response.completed`` (``response.incomplete`` when ``max_output_tokens``
cut it, ``response.failed`` when it failed).

Nothing is stored: every answer says ``store: false`` whatever the request asked, and
``previous_response_id``, ``conversation`` and ``background`` are refused (send the whole
conversation as ``input``). Hosted tools, images and files are refused as well.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from llmctl.server.dialects.bridge import ChatRun, Piece, Reply, client_gone, first_call_only, parse, renamed
from llmctl.server.protocol import STRICT, APIError, ChatCompletionRequest, bad_request
from llmctl.server.serving import OpenAIServing

OPENAI_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
TEXT_PARTS = ("input_text", "output_text", "text")


class TextConfig(BaseModel):
    model_config = STRICT

    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ReasoningConfig(BaseModel):
    model_config = STRICT

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None  # the reasoning comes whole, as reasoning_text


class ResponsesRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None  # accepted; nothing is stored
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None  # how long the model stays loaded (llmctl/server/model_manager.py)

    def refuse_unsupported(self) -> None:
        if self.previous_response_id is not None:
            raise bad_request(
                "previous_response_id is not supported: this server stores no responses (store is always "
                "false); send the whole conversation as input",
                "previous_response_id",
            )
        refused = {
            "conversation": (self.conversation is not None, "this server stores no conversations"),
            "background": (bool(self.background), "responses run in the foreground only"),
            "prompt": (self.prompt is not None, "stored prompt templates need server-side state"),
            "truncation": (self.truncation == "auto", "a prompt over the context is refused, never truncated"),
            "top_logprobs": (bool(self.top_logprobs), "logprobs are not supported here (use /v1/chat/completions)"),
            "max_tool_calls": (self.max_tool_calls is not None, "a response makes the calls of one model answer"),
        }
        for name, (asked, why) in refused.items():
            if asked:
                raise bad_request(f"{name} is not supported: {why}", name)
        if "message.output_text.logprobs" in (self.include or []):
            raise bad_request("include message.output_text.logprobs is not supported here", "include")


def _text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{where}: {kind} is not supported: this server runs a text-only model", "input")
        else:
            raise bad_request(f"{where}: content parts of type {kind!r} are not supported", "input")
    return "".join(texts)


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    reasoning: str | None = None  # a reasoning item goes with the assistant message after it
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            message = {"role": item["role"], "content": _text(item.get("content"), where)}
            if item["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            out.append(message)
        elif kind == "function_call":
            call = {
                "id": str(item.get("call_id", "")),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"},
            }
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, where)
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            parts = parts if isinstance(parts, list) else []
            reasoning = "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported", "input")
    return out


def _tools(req: ResponsesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if req.tools:
        tools = []
        for tool in req.tools:
            if tool.get("type") != "function":
                raise bad_request(
                    f"tools: {tool.get('type')!r} tools are not supported here; function tools only", "tools"
                )
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            tools.append({"type": "function", "function": function})
        fields["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise bad_request('tool_choice: only {"type": "function", "name": ...} is supported', "tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        fields["tool_choice"] = choice
    return fields


def _format(req: ResponsesRequest) -> dict[str, Any]:
    fmt = (req.text.format if req.text else None) or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format: json_schema needs a schema (an object)", "text.format")
        schema = {"name": fmt.get("name") or "format", "schema": fmt["schema"], "strict": fmt.get("strict")}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise bad_request(f"text.format: type {kind!r} is not supported", "text.format")


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    body: dict[str, Any] = {
        "model": req.model,
        "messages": _messages(req),
        "stream": True,
        "stream_options": {"include_usage": True},
        **_tools(req),
        **_format(req),
    }
    for name, field in (
        ("max_output_tokens", "max_completion_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("user", "user"),
    ):
        if getattr(req, name) is not None:
            body[field] = getattr(req, name)
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    return parse(body, ChatCompletionRequest)


# ---- answers ------------------------------------------------------------------------------------
class _Ids:
    def __init__(self) -> None:
        self.response = f"resp_{uuid.uuid4().hex}"

    @staticmethod
    def new(prefix: str) -> str:
        return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {
            "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
        },
        "total_tokens": usage.get("total_tokens", 0),
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class _Shell:
    """The response object around the output: what the request asked, echoed as OpenAI does."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str) -> None:
        self.req = req
        self.id = response_id
        self.model = model
        self.created = time.time()

    def __call__(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        req = self.req
        fmt = (req.text.format if req.text else None) or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": False,
            "temperature": req.temperature,
            "text": {"format": fmt},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _output(reply: Reply, keep_calls: Any) -> list[dict[str, Any]]:
    """The output items; the last one carries the answer's status (``incomplete`` where
    ``max_output_tokens`` cut it), those before it were complete, as a stream closes them."""
    output = []
    if reply.reasoning is not None:
        output.append(_reasoning_item(_Ids.new("rs"), reply.reasoning, "completed"))
    if reply.content or not (reply.tool_calls or output):  # an empty answer: an empty message
        output.append(_message_item(_Ids.new("msg"), reply.content, "completed"))
    for call in keep_calls([{**c, "index": i} for i, c in enumerate(reply.tool_calls)]):
        function = call["function"]
        output.append(_call_item(_Ids.new("fc"), call["id"], function["name"], function["arguments"], "completed"))
    output[-1]["status"] = _status(reply.finish_reason)
    return output


async def create_response(serving: OpenAIServing, raw: bytes, request: Request) -> Response:
    req = parse(raw, ResponsesRequest)
    serving.generation_target(req.model)  # the base model or an adapter; 404 for neither
    req.refuse_unsupported()
    chat = chat_request(req)
    keep_calls = first_call_only(req.parallel_tool_calls is not False)
    try:
        run = await ChatRun.start(serving, chat, request)
    except APIError as exc:
        raise renamed(exc, OPENAI_NAMES) from None
    if not isinstance(run, ChatRun):
        return run
    shell = _Shell(req, _Ids().response, req.model or serving.served_model_name)
    if not req.stream:
        reply = await run.reply(request)
        if reply is None:
            return client_gone()
        return JSONResponse(shell(_status(reply.finish_reason), _output(reply, keep_calls), _usage(reply.usage)))
    return run.streaming(_Events(shell, run, keep_calls).stream())


class _Events:
    """The Responses stream: one output item open at a time (reasoning, message, or a function
    call), each opened, filled by deltas and closed with its done events."""

    def __init__(self, shell: _Shell, run: ChatRun, keep_calls: Any) -> None:
        self.shell = shell
        self.run = run
        self.keep_calls = keep_calls
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # {"kind", "id", "text", and a call's "call_id", "name"}

    def event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def _item(self, status: str) -> dict[str, Any]:
        open_ = self.open or {}
        if open_["kind"] == "reasoning":
            return _reasoning_item(open_["id"], open_["text"], status)
        if open_["kind"] == "message":
            return _message_item(open_["id"], open_["text"] if status != "in_progress" else None, status)
        return _call_item(open_["id"], open_["call_id"], open_["name"], open_["text"], status)

    def start(self, kind: str, **extra: Any) -> list[str]:
        events = self.finish("completed")
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        self.open = {"kind": kind, "id": _Ids.new(prefix), "text": "", **extra}
        index = len(self.output)
        item = self._item("in_progress")
        events.append(self.event("response.output_item.added", output_index=index, item=item))
        if kind == "message":
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=_text_part(""),
                )
            )
        return events

    def delta(self, text: str) -> str:
        open_ = self.open or {}
        open_["text"] += text
        where = {"item_id": open_["id"], "output_index": len(self.output)}
        if open_["kind"] == "reasoning":
            return self.event("response.reasoning_text.delta", **where, content_index=0, delta=text)
        if open_["kind"] == "message":
            return self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])
        return self.event("response.function_call_arguments.delta", **where, delta=text)

    def finish(self, status: str) -> list[str]:
        if self.open is None:
            return []
        open_, index = self.open, len(self.output)
        where = {"item_id": open_["id"], "output_index": index}
        events = []
        if open_["kind"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=open_["text"]))
        elif open_["kind"] == "message":
            events.append(
                self.event("response.output_text.done", **where, content_index=0, text=open_["text"], logprobs=[])
            )
            events.append(
                self.event("response.content_part.done", **where, content_index=0, part=_text_part(open_["text"]))
            )
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done", **where, name=open_["name"], arguments=open_["text"]
                )
            )
        item = self._item(status)
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        self.open = None
        return events

    def on_piece(self, piece: Piece) -> list[str]:
        events = []
        if piece.reasoning:
            if (self.open or {}).get("kind") != "reasoning":
                events += self.start("reasoning")
            events.append(self.delta(piece.reasoning))
        if piece.content:
            if (self.open or {}).get("kind") != "message":
                events += self.start("message")
            events.append(self.delta(piece.content))
        for call in self.keep_calls(piece.tool_calls):
            function = call.get("function") or {}
            if "id" in call:
                events += self.start("function_call", call_id=call["id"], name=function.get("name", ""))
            if function.get("arguments"):
                events.append(self.delta(function["arguments"]))
        return events

    async def stream(self) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.shell("in_progress", []))
        yield self.event("response.in_progress", response=self.shell("in_progress", []))
        finish_reason = None
        try:
            async for piece in self.run.pieces():
                for event in self.on_piece(piece):
                    yield event
                if piece.finish_reason is not None:
                    finish_reason = piece.finish_reason
        except APIError as exc:
            error = {"code": exc.code or "server_error", "message": exc.message}
            yield self.event("error", code=error["code"], message=exc.message, param=None)
            yield self.event("response.failed", response=self.shell("failed", self.output, None, error))
            return
        status = _status(finish_reason)
        if not self.output and self.open is None:  # nothing was written: an empty message, as a whole answer has
            for event in self.start("message"):
                yield event
        for event in self.finish(status):
            yield event
        done = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self.event(done, response=self.shell(status, self.output, _usage(self.run.usage)))
