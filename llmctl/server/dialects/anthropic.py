"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request becomes a chat request: ``system`` (a string or text blocks) the system message; text
blocks the messages' text; an assistant's ``tool_use`` blocks its tool calls and ``thinking``
blocks its earlier reasoning; a user's ``tool_result`` blocks tool messages; ``tools`` (client
tools) and ``tool_choice`` the chat path's tools; ``stop_sequences`` its stop strings;
``metadata.user_id`` its fairness key. The answer comes back as content blocks (``thinking`` from
the reasoning parser, ``text``, ``tool_use``) with ``stop_reason`` ``end_turn``, ``max_tokens``,
``stop_sequence`` (and ``stop_sequence``) or ``tool_use``; streamed as Anthropic's server-sent
events (``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``,
``content_block_stop``, ``message_delta``, ``message_stop``).

``model`` may name a LoRA adapter: it goes along to the chat path, which runs the adapter
(``OpenAIServing.generation_target``), as ``/v1/chat/completions`` does.

Images and documents (this is a text model), server tools, and a temperature outside Anthropic's
[0, 1] are refused with Anthropic's error JSON. ``thinking.budget_tokens`` is accepted but not
enforced apart from ``max_tokens``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from llmctl.server.dialects.bridge import ChatRun, Piece, client_gone, first_call_only, parse, prompt_tokens, renamed
from llmctl.server.protocol import STRICT, APIError, ChatCompletionRequest, bad_request
from llmctl.server.serving import OpenAIServing

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
OPENAI_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def owns(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(exc: APIError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``, the type named by the status."""
    kind = ERROR_TYPES.get(exc.status_code, "api_error" if exc.status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


# ---- requests -----------------------------------------------------------------------------------
class MessageParam(BaseModel):
    model_config = STRICT

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolParam(BaseModel):
    model_config = STRICT

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" (or absent): a client tool; others are Anthropic's server tools


class ToolChoiceParam(BaseModel):
    model_config = STRICT

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingParam(BaseModel):
    model_config = STRICT

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputConfig(BaseModel):
    model_config = STRICT

    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": {...}}: structured output
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Metadata(BaseModel):
    model_config = STRICT

    user_id: str | None = None


class CountTokensRequest(BaseModel):
    model_config = STRICT

    model: str
    messages: list[MessageParam]
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    keep_alive: str | int | float | None = None  # how long the model stays loaded (llmctl/server/model_manager.py)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    service_tier: str | None = None  # accepted; changes nothing here
    output_config: OutputConfig | None = None


def _text_of(blocks: str | list[dict[str, Any]], where: str) -> str:
    """The text of a string or a list of text blocks (``cache_control`` and citations ignored)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"{where}: must be a string or a list of content blocks")
    texts = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _unsupported_block(kind, where)
        texts.append(block["text"])
    return "".join(texts)


def _unsupported_block(kind: Any, where: str) -> APIError:
    if kind in ("image", "document", "search_result"):
        return bad_request(f"{where}: {kind} content blocks are not supported: this server runs a text-only model")
    return bad_request(f"{where}: content blocks of type {kind!r} are not supported here")


def _messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic's system and messages as chat messages."""
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, message in enumerate(req.messages):
        where = f"messages.{i}.content"
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        if message.role == "assistant":
            out.append(_assistant(blocks, where))
            continue
        text: list[str] = []
        for block in blocks:
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_result":
                if text:  # text before a result stays before it
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                content = _text_of(block.get("content") or "", f"{where} (tool_result)")
                if block.get("is_error"):
                    content = f"Error: {content}"
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": content})
            else:
                raise _unsupported_block(kind, where)
        if text or not blocks:
            out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    text, thinking, calls = [], [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue  # opaque, and never written by this server
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            calls.append(
                {
                    "id": str(block.get("id", "")),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": arguments},
                }
            )
        else:
            raise _unsupported_block(kind, where)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(req: CountTokensRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if req.tools:
        for tool in req.tools:
            if tool.type not in (None, "custom"):
                raise bad_request(
                    f"tools: server tools ({tool.type}) are not supported here; client tools only", "tools"
                )
        fields["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice: type tool needs a name", "tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif req.tools:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields


def chat_request(req: CountTokensRequest, serving: OpenAIServing) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req), **_tools(req)}
    if req.thinking is not None and req.thinking.type == "disabled":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    if isinstance(req, MessagesRequest):
        body |= {"max_completion_tokens": req.max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.stop_sequences:
            body["stop"] = list(req.stop_sequences)
        if req.metadata is not None and req.metadata.user_id is not None:
            body["user"] = req.metadata.user_id
        body |= _output_config(req.output_config)
    return parse(body, ChatCompletionRequest)


def _output_config(config: OutputConfig | None) -> dict[str, Any]:
    """``format`` as structured output; ``effort`` as the template's ``reasoning_effort`` (past
    ``high``, ``high``: the chat templates that read it know three levels)."""
    if config is None:
        return {}
    fields: dict[str, Any] = {}
    if config.effort is not None:
        fields["reasoning_effort"] = config.effort if config.effort in ("low", "medium", "high") else "high"
    fmt = config.format
    if fmt is not None:
        if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise bad_request('output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config")
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return fields


# ---- answers ------------------------------------------------------------------------------------
def _stop(finish_reason: str | None, stop_reason: str | int | None, stops: list[str]) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a chat finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in stops:
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "output_tokens": usage.get("completion_tokens", 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object; ``{}`` for arguments cut short (``stop_reason: max_tokens``)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _message(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    stop: tuple[str | None, str | None],
    usage: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class _Blocks:
    """The stream's content blocks: one open at a time; a new kind closes the open one."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.pinged = False

    def open(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.kind = kind
        events.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        if not self.pinged:
            self.pinged = True
            events.append(_event("ping", {}))
        return events

    def ensure(self, kind: str, block: dict[str, Any]) -> list[str]:
        return [] if self.kind == kind else self.open(kind, block)

    def delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        events = []
        if self.kind == "thinking":
            events.append(self.delta({"type": "signature_delta", "signature": ""}))
        events.append(_event("content_block_stop", {"index": self.index}))
        self.kind = None
        return events


async def create_message(serving: OpenAIServing, raw: bytes, request: Request) -> Response:
    req = parse(raw, MessagesRequest)
    serving.generation_target(req.model)  # the base model or an adapter; 404 for neither
    chat = chat_request(req, serving)
    stops = list(req.stop_sequences or [])
    keep_calls = first_call_only(not (req.tool_choice and req.tool_choice.disable_parallel_tool_use))
    input_tokens = prompt_tokens(serving, chat) if req.stream else 0
    try:
        run = await ChatRun.start(serving, chat, request)
    except APIError as exc:
        raise renamed(exc, OPENAI_NAMES) from None
    if not isinstance(run, ChatRun):
        return run
    message_id = f"msg_{uuid.uuid4().hex}"
    if not req.stream:
        reply = await run.reply(request)
        if reply is None:
            return client_gone()
        content: list[dict[str, Any]] = []
        if reply.reasoning is not None:
            content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
        if reply.content or not (reply.tool_calls or content):  # an empty answer: an empty text block
            content.append({"type": "text", "text": reply.content})
        for call in keep_calls([{**c, "index": i} for i, c in enumerate(reply.tool_calls)]):
            function = call["function"]
            content.append(
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": function["name"],
                    "input": _tool_input(function["arguments"]),
                }
            )
        stop = _stop(reply.finish_reason, reply.stop_reason, stops)
        return JSONResponse(_message(message_id, req.model, content, stop, _usage(reply.usage)))

    async def events() -> AsyncIterator[str]:
        blocks = _Blocks()
        start = _message(
            message_id, req.model, [], (None, None), {**_usage({"prompt_tokens": input_tokens}), "output_tokens": 0}
        )
        yield _event("message_start", {"message": start})
        last = Piece()
        try:
            async for piece in run.pieces():
                for event in _piece_events(blocks, piece, keep_calls):
                    yield event
                if piece.finish_reason is not None:
                    last = piece
        except APIError as exc:
            yield _event("error", {"error": error_body(exc)["error"]})
            return
        if blocks.index < 0:  # nothing was written: one empty text block, as a whole answer has
            for event in blocks.open("text", {"type": "text", "text": ""}):
                yield event
        for event in blocks.close():
            yield event
        stop_reason, stop_sequence = _stop(last.finish_reason, last.stop_reason, stops)
        yield _event(
            "message_delta",
            {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": _usage(run.usage)},
        )
        yield _event("message_stop", {})

    return run.streaming(events())


def _piece_events(blocks: _Blocks, piece: Piece, keep_calls: Any) -> list[str]:
    events = []
    if piece.reasoning:
        events += blocks.ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        events.append(blocks.delta({"type": "thinking_delta", "thinking": piece.reasoning}))
    if piece.content:
        events += blocks.ensure("text", {"type": "text", "text": ""})
        events.append(blocks.delta({"type": "text_delta", "text": piece.content}))
    for call in keep_calls(piece.tool_calls):
        function = call.get("function") or {}
        if "id" in call:  # a new call
            events += blocks.open(
                "tool_use", {"type": "tool_use", "id": call["id"], "name": function.get("name"), "input": {}}
            )
        if function.get("arguments"):
            events.append(blocks.delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
    return events


async def count_tokens(serving: OpenAIServing, raw: bytes) -> dict[str, Any]:
    req = parse(raw, CountTokensRequest)
    serving.generation_target(req.model)  # an adapter shares its base model's tokenizer
    return {"input_tokens": prompt_tokens(serving, chat_request(req, serving))}
