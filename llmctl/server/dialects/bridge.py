"""A translated request run through the OpenAI path, read back as pieces of an answer.

Every API here is a translation: its request becomes a ``ChatCompletionRequest`` (or, for raw text,
a ``CompletionRequest``), which ``OpenAIServing`` checks, renders, queues and streams exactly as it
does for ``/v1/chat/completions``. The bridge always asks for a stream with usage: the stream starts
only once the engine accepted the request (so refusals are still plain errors), each chunk becomes
a :class:`Piece` (reasoning, answer text, tool-call deltas, finish), and a non-streamed answer is
those pieces joined (the chat path's streamed and whole answers are the same text, tool calls
and reasoning split included). Closing the run aborts its engine request, whether the answer
ended, the client went away, or the translation failed.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from llmctl.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request
from llmctl.server.serving import (
    SSE_DONE,
    ClientGone,
    EngineStreamResponse,
    OpenAIServing,
    unless_disconnected,
)
from llmctl.structured.tool_calls import merge_calls

Body = TypeVar("Body", bound=BaseModel)
CLIENT_CLOSED_REQUEST = 499


def describe_validation_errors(errors: Iterable[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's errors as one line, and the first offending field."""
    parts, param = [], None
    for error in errors:
        loc = [str(p) for p in error.get("loc", ())]
        if error.get("type") == "json_invalid":
            return f"malformed JSON body: {error.get('ctx', {}).get('error', error.get('msg'))}", None
        if error.get("type") == "model_type" and not loc:
            return "the request body must be a JSON object", None
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "; ".join(parts) or "invalid request", param


def parse(raw: bytes | dict[str, Any], model: type[Body]) -> Body:
    """``raw`` (a JSON body, or a dict built by a translation) as ``model``, validated strictly."""
    try:
        if isinstance(raw, dict):
            return model.model_validate(raw)
        return model.model_validate_json(raw)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise bad_request(message, param) from None


def renamed(exc: APIError, names: dict[str, str]) -> APIError:
    """``exc`` with the OpenAI field names in its message and ``param`` replaced by this API's."""
    message, param = exc.message, exc.param
    for openai_name, name in names.items():
        message = message.replace(openai_name, name)
        if param == openai_name:
            param = name
    return APIError(exc.status_code, message, type=exc.type, param=param, code=exc.code, headers=exc.headers)


@dataclass
class Piece:
    """One chunk of the answer: new reasoning, new answer text, tool-call deltas (OpenAI's, with
    ``index``; a call's first delta has its ``id`` and name), and the finish once it comes."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class Reply:
    """A whole answer: the pieces joined."""

    reasoning: str | None
    content: str
    tool_calls: list[dict[str, Any]]  # complete calls: id, type, function {name, arguments}
    finish_reason: str | None
    stop_reason: str | int | None
    usage: dict[str, Any]


def _stream_error(error: dict[str, Any]) -> APIError:
    """The chat stream's error event as the error it was (for a status, where one can still be sent)."""
    code = error.get("code")
    status = 503 if code in ("shutting_down", "queue_full") else 500
    return APIError(
        status, error.get("message") or "request failed", type=error.get("type") or "server_error", code=code
    )


class ChatRun:
    """One request's answer as it streams out of the OpenAI path."""

    def __init__(self, response: EngineStreamResponse, started: float) -> None:
        self.response = response
        self.started = started  # monotonic: before the request was rendered
        self.first = time.monotonic()  # the engine accepted it and produced the first token
        self.ended: float | None = None
        self.usage: dict[str, Any] = {}

    @classmethod
    async def start(
        cls, serving: OpenAIServing, req: ChatCompletionRequest | CompletionRequest, request: Request
    ) -> ChatRun | Response:
        """The run, or the response to give at once (the client left before the engine accepted
        it). Errors before the first token (a 400, a full queue) raise ``APIError``."""
        started = time.monotonic()
        if isinstance(req, ChatCompletionRequest):
            response = await serving.create_chat_completion(req, request)
        else:
            response = await serving.create_completion(req, request)
        if not isinstance(response, EngineStreamResponse):
            return response
        return cls(response, started)

    async def pieces(self) -> AsyncIterator[Piece]:
        """The answer's pieces; an ``APIError`` if it fails on the way."""
        async for event in self.response.body_iterator:
            text = event if isinstance(event, str) else bytes(event).decode()
            if text == SSE_DONE:
                break
            data = json.loads(text.removeprefix("data: "))
            if "error" in data:
                raise _stream_error(data["error"])
            if data.get("usage"):
                self.usage = data["usage"]
            for choice in data.get("choices", ()):
                delta = choice.get("delta")
                if delta is None:  # a completions chunk
                    delta = {"content": choice.get("text", "")}
                yield Piece(
                    reasoning=delta.get("reasoning_content") or "",
                    content=delta.get("content") or "",
                    tool_calls=delta.get("tool_calls") or [],
                    finish_reason=choice.get("finish_reason"),
                    stop_reason=choice.get("stop_reason"),
                )
        self.ended = time.monotonic()

    async def _join(self) -> Reply:
        reasoning: str | None = None
        content, deltas = [], []
        finish_reason, stop_reason = None, None
        async for piece in self.pieces():
            if piece.reasoning:
                reasoning = (reasoning or "") + piece.reasoning
            content.append(piece.content)
            deltas.extend(piece.tool_calls)
            if piece.finish_reason is not None:
                finish_reason, stop_reason = piece.finish_reason, piece.stop_reason
        return Reply(reasoning, "".join(content), merge_calls(deltas), finish_reason, stop_reason, self.usage)

    async def reply(self, request: Request) -> Reply | None:
        """The whole answer; None if the client went away first (its request is then aborted)."""
        try:
            return await unless_disconnected(request, self._join())
        except ClientGone:
            return None
        finally:
            self.close()

    def close(self) -> None:
        self.response.on_close()

    def streaming(self, content: AsyncIterator[str], media_type: str = "text/event-stream") -> EngineStreamResponse:
        """``content`` (this API's events, made from ``pieces``) as the response; the engine request
        is aborted when it ends for any reason."""
        return EngineStreamResponse(content, on_close=self.close, media_type=media_type)


def client_gone() -> Response:
    return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it


def prompt_tokens(serving: OpenAIServing, req: ChatCompletionRequest) -> int:
    """How many tokens ``req``'s messages render to (what its ``usage`` will count)."""
    text = serving.render_chat(req.messages, req)
    return len(serving.tokenizer.encode(text, add_special_tokens=False))


def first_call_only(keep: bool) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]]:
    """A filter of tool-call deltas: all of them, or (``keep`` false: the API forbids parallel
    calls) those of the first call alone."""

    def only_first(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return deltas if keep else [d for d in deltas if d.get("index", 0) == 0]

    return only_first
