"""The completions and chat endpoints: an OpenAI request becomes engine requests (one per prompt),
and the engine's per-step outputs become an OpenAI response or a stream of server-sent events.

A request is checked (model, prompt length) before anything is queued; the engine itself checks
the queue limit atomically with the add (``EngineBusyError``: 503 + Retry-After). A streamed
response starts only once every prompt produced its first output, so a request the engine refuses
gets a proper 400 instead of a broken stream. From the moment a request is queued until it ends,
a client that goes away aborts it: the engine frees its blocks at the next step boundary.

A request that fails on its own (the engine finishes it with ``finish_reason`` "error", e.g. its
detokenizer raised) is answered with a 500 naming the cause, or, once its stream has started, with
an error event and ``[DONE]``; the other requests go on. The same happens to the requests still
running when a drain is cut short (``ServerState.cancel_all``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from llmctl.engine.async_engine import AsyncEngine, EngineDeadError
from llmctl.engine.outputs import CompletionOutput, RequestOutput
from llmctl.errors import EngineBusyError, InvalidRequestError
from llmctl.reasoning import ReasoningParser, ReasoningSplit, reasoning_gate, thinking_disabled
from llmctl.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from llmctl.server.logprobs import LogprobsFormatter, TokenTexts
from llmctl.server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    ChatTemplateFields,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionTokensDetails,
    DeltaMessage,
    PromptLogprobs,
    PromptTokensDetails,
    Usage,
    bad_request,
)
from llmctl.structured.spec import StructuredOutputSpec
from llmctl.structured.tool_calls import ParsedDelta, ReplyParser, reply_parser
from llmctl.structured.tools import messages_for_template, template_variables, tool_choice_spec
from llmctl.tokenizer import Tokenizer

T = TypeVar("T")
logger = logging.getLogger("llmctl.server")
RETRY_AFTER_S = 1


def queue_full(detail: str) -> APIError:
    return APIError(
        503,
        f"the server is overloaded: {detail} (--max-queue)",
        type="server_error",
        code="queue_full",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def request_failed(out: RequestOutput) -> APIError:
    return APIError(
        500,
        f"this request failed while its output was produced: {out.error or 'unknown error'}",
        type="server_error",
        code="request_failed",
    )


def shutting_down(message: str) -> APIError:
    return APIError(
        503, message, type="server_error", code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)}
    )


SSE_DONE = "data: [DONE]\n\n"


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class ChunkEvents:
    """The SSE events of one streamed response, whose chunks differ only in their choices: the
    envelope (id, created, model) is encoded once, each chunk's choice per event, so an event is
    byte for byte its whole chunk's JSON for a fraction of the work."""

    def __init__(self, empty: ChatCompletionChunk | CompletionChunk) -> None:
        head, choices, tail = empty.to_json().partition('"choices":[]')
        if not choices:
            raise ValueError("a chunk without choices encodes them as []")
        self._head, self._tail = f'{head}"choices":[', f"]{tail}"

    def event(self, choice: ChatStreamChoice | CompletionStreamChoice) -> str:
        return sse(self._head + choice.to_json() + self._tail)


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body was already read, so ``receive`` only reports
    the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``, but raise ``ClientGone`` (cancelling it) if the client leaves first."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientGone
    finally:
        work.cancel()
        watcher.cancel()


def _api_error(exc: BaseException) -> APIError:
    """The answer to an engine request that raised ``exc``."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        message = str(exc)
        return bad_request(message, "prompt" if message.startswith("prompt") else None)
    if isinstance(exc, EngineBusyError):
        return queue_full(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), type="server_error", code="engine_dead")
    return APIError(500, f"internal error: {exc!r}", type="server_error")


class Generation:
    """The engine requests of one API call (one per prompt), as one stream of
    ``(prompt_index, RequestOutput)`` in the order the engine produced them.

    One prompt (the common case, whatever ``n``) is read straight from ``AsyncEngine.generate``;
    several are merged, each prompt's stream pumped by its own task into one queue. With
    ``final_only`` (a response that is not streamed) each request hands over its finished output
    alone. ``cancel`` ends whatever has not finished (its engine request is aborted); it is
    synchronous so that it also works from a ``finally`` inside an already-cancelled stream."""

    def __init__(
        self,
        async_engine: AsyncEngine,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str,
        user: str | None,
        priority: int = 0,
        lora: str | None = None,
        final_only: bool = False,
    ) -> None:
        self.num_prompts = len(prompts)
        self.num_requests = self.num_prompts * params.n
        adapter = {} if lora is None else {"lora": lora}  # the engine's LoRA adapter by name
        self._async_engine = async_engine
        self._request_ids = [f"{request_id}-{i}" if self.num_prompts > 1 else request_id for i in range(len(prompts))]
        self._streams: list[AsyncGenerator[RequestOutput, None]] = [
            async_engine.generate(
                prompt, params, final_only=final_only, request_id=rid, user=user, priority=priority, **adapter
            )
            for prompt, rid in zip(prompts, self._request_ids)
        ]
        self._unfinished = set(range(self.num_prompts))
        self._buffer: list[tuple[int, RequestOutput]] = []
        self._failure: APIError | None = None
        self.final: dict[int, RequestOutput] = {}
        self._merged: asyncio.Queue[tuple[int, RequestOutput | BaseException]] | None = None
        self._tasks: list[asyncio.Task] = []
        if self.num_prompts > 1:
            self._merged = asyncio.Queue()
            self._tasks = [asyncio.create_task(self._pump(i, stream)) for i, stream in enumerate(self._streams)]

    async def _pump(self, index: int, outputs: AsyncIterator[RequestOutput]) -> None:
        assert self._merged is not None
        try:
            async for out in outputs:
                self._merged.put_nowait((index, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it in the request's context
            self._merged.put_nowait((index, exc))

    async def _receive(self) -> tuple[int, RequestOutput | BaseException]:
        if self._merged is not None:
            return await self._merged.get()
        try:
            return 0, await anext(self._streams[0])
        except StopAsyncIteration:  # never read past the finished output; it means the stream was closed
            return 0, APIError(500, "the request's output stream ended early", type="server_error")
        except Exception as exc:  # noqa: BLE001 - raised below as the API error it stands for
            return 0, exc

    async def _next(self) -> tuple[int, RequestOutput]:
        index, item = await self._receive()
        if self._failure is not None:
            raise self._failure
        if isinstance(item, BaseException):
            raise _api_error(item)
        if item.error is not None or any(c.finish_reason == "error" for c in item.outputs):
            raise request_failed(item)
        self.final[index] = item
        if item.finished:
            self._unfinished.discard(index)
        return index, item

    async def started(self) -> None:
        """Wait until every prompt has its first output (so the engine accepted them all)."""
        seen: set[int] = set()
        while len(seen) < self.num_prompts:
            index, out = await self._next()
            seen.add(index)
            self._buffer.append((index, out))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._buffer:
            yield self._buffer.pop(0)
        while self._unfinished:
            yield await self._next()

    async def finish(self) -> dict[int, RequestOutput]:
        async for _ in self.outputs():
            pass
        return self.final

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._merged is None:
            stream = self._streams[0]
            # A stream being read is closed by its reader's cancellation; one that is not (never
            # started, or paused at an output) is closed here, which aborts it unless it finished.
            if not stream.ag_running and stream.ag_frame is not None:
                asyncio.ensure_future(stream.aclose())

    def fail(self, error: APIError) -> None:
        """End this API call with ``error`` (its stream: an error event, then ``[DONE]``) at its next
        output; its engine requests are aborted. A request still being added sees it at its
        first output."""
        self._failure = error
        if self._merged is not None:
            self._merged.put_nowait((-1, error))
        else:
            self._async_engine.fail(self._request_ids[0], error)

    def usage(self) -> Usage:
        prompt = sum(len(out.prompt_token_ids) for out in self.final.values())
        completion = sum(len(c.token_ids) for out in self.final.values() for c in out.outputs)
        cached = sum(out.num_cached_tokens for out in self.final.values())
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


async def _errors_as_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """If the request fails mid-stream, tell the client in an error event, then end the stream."""
    try:
        async for event in events:
            yield event
    except APIError as exc:
        yield sse(json.dumps(exc.body()))
        yield SSE_DONE
    except Exception as exc:  # a bug in building this response: this stream alone ends
        logger.exception("streamed response failed")
        yield sse(json.dumps(APIError(500, f"internal error: {exc!r}", type="server_error").body()))
        yield SSE_DONE


class EngineStreamResponse(StreamingResponse):
    """Server-sent events whose engine requests are aborted when the response ends for any reason:
    finished, client gone (Starlette cancels the body), or never started. ``media_type``: another
    streamed format (Ollama's NDJSON) with the same life."""

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], None], media_type: str = "text/event-stream"
    ) -> None:
        super().__init__(
            content, media_type=media_type, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


@dataclass
class _ChoiceStream:
    """What one streamed choice already sent."""

    texts: TokenTexts
    started: bool = False
    finished: bool = False
    sent_tool_calls: bool = False
    split: ReasoningSplit | None = None  # with a reasoning parser: the think block's tokens
    reasoning_sent: int = 0  # characters of reasoning and of answer already sent
    answer_sent: int = 0
    parser: ReplyParser | None = None  # with tools: the reply's tool calls


@dataclass
class ServerState:
    """Shared by the routes and the process: drain flag and the API calls being answered."""

    draining: bool = False
    rejected_queue_full: int = 0
    started: float = field(default_factory=time.time)
    live: set[Generation] = field(default_factory=set)

    @property
    def in_flight(self) -> int:
        return len(self.live)

    def cancel_all(self, message: str) -> int:
        """Fail every API call still running (a drain cut short); how many engine requests that was."""
        cancelled = sum(generation.num_requests for generation in self.live)
        for generation in self.live:
            generation.fail(shutting_down(message))
        return cancelled


@dataclass(frozen=True)
class ChatTemplatePolicy:
    """``llmctl serve``'s chat-template settings: whether a request may bring its own template (a
    template is code that runs in the server, so vLLM too asks for the flag), and the template
    variables every request starts from (``--default-chat-template-kwargs``)."""

    trust_request_chat_template: bool = False
    default_kwargs: dict[str, Any] = field(default_factory=dict)


class OpenAIServing:
    def __init__(
        self,
        async_engine: AsyncEngine,
        *,
        served_model_name: str,
        model_aliases: set[str],
        state: ServerState,
        chat_templates: ChatTemplatePolicy | None = None,
        reasoning_parser: ReasoningParser | None = None,
    ) -> None:
        engine = async_engine.engine
        if engine.tokenizer is None:
            raise ValueError("the server needs a tokenizer (the engine was built with skip_tokenizer)")
        self.async_engine = async_engine
        self.tokenizer: Tokenizer = engine.tokenizer
        self.logprobs = LogprobsFormatter(engine.tokenizer)
        self.max_model_len = engine.max_model_len
        self.vocab_size: int = engine.model.config.vocab_size
        self.served_model_name = served_model_name
        self.model_aliases = {served_model_name, *model_aliases}
        self.state = state
        self.chat_templates = chat_templates or ChatTemplatePolicy()
        self.reasoning_parser = reasoning_parser

    # ---- checks --------------------------------------------------------------------------------
    def lora_names(self) -> list[str]:
        return self.async_engine.engine.lora_names()

    def check_model(self, model: str | None) -> None:
        """The base model only (embeddings and the tokenizer routes): a LoRA adapter's name is
        refused by name."""
        if model is not None and model in self.lora_names():
            raise bad_request(
                f"`{model}` is a LoRA adapter: adapters serve /v1/completions, /v1/chat/completions, "
                "/v1/messages, /v1/responses, /api/chat and /api/generate",
                "model",
            )
        if model is not None and model not in self.model_aliases:
            raise APIError(
                404,
                f"The model `{model}` does not exist (this server serves `{self.served_model_name}`)",
                param="model",
                code="model_not_found",
            )

    def generation_target(self, model: str | None) -> str | None:
        """The LoRA adapter a completion names as its ``model`` (None: the base model); an unknown
        name is a 404."""
        if model is None or model in self.model_aliases:
            return None
        if model in self.lora_names():
            return model
        self.check_model(model)  # a 404
        return None

    def check_capacity(self) -> None:
        if self.state.draining:
            raise shutting_down("the server is shutting down")

    def _max_tokens(self, prompt_len: int, requested: int | None, param: str) -> int:
        """The requested budget, or all the context the prompt leaves. A prompt that leaves no room
        goes on to the engine, which refuses it with its own message."""
        room = self.max_model_len - prompt_len
        if requested is None:
            return max(room, 1)
        if room > 0 and requested > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for "
                f"the completion). Please reduce the length of the prompt or of {param}.",
                param,
            )
        return requested

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt is empty", "prompt")
            return self.tokenizer.encode(prompt)
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        if not all(0 <= t < self.vocab_size for t in prompt):
            raise bad_request(f"prompt token ids must be integers in [0, {self.vocab_size})", "prompt")
        return list(prompt)

    # ---- running -------------------------------------------------------------------------------
    async def _run(
        self,
        request: Request,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str,
        user: str | None,
        respond: Callable[[Generation], Any],
        stream: Callable[[Generation], AsyncIterator[str]] | None,
        priority: int = 0,
        lora: str | None = None,
    ) -> Any:
        self.check_capacity()
        generation = Generation(
            self.async_engine, prompts, params, request_id, user, priority, lora, final_only=stream is None
        )
        self.state.live.add(generation)
        handed_over = False
        try:
            try:
                await unless_disconnected(request, generation.started())
            except APIError as exc:
                if exc.code == "queue_full":
                    self.state.rejected_queue_full += 1
                raise
            if stream is None:
                await unless_disconnected(request, generation.finish())
                return JSONResponse(respond(generation))
            handed_over = True
            return EngineStreamResponse(_errors_as_events(stream(generation)), on_close=self._closer(generation))
        except ClientGone:
            return JSONResponse({}, status_code=499)  # nobody reads it
        finally:
            if not handed_over:
                generation.cancel()
                self.state.live.discard(generation)

    def _closer(self, generation: Generation) -> Callable[[], None]:
        closed = False

        def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                generation.cancel()
                self.state.live.discard(generation)

        return close

    # ---- completions ---------------------------------------------------------------------------
    async def create_completion(self, req: CompletionRequest, request: Request) -> Any:
        lora = self.generation_target(req.model)
        req.refuse_unsupported()
        prompts = [req.truncated(self._encode(p), self.max_model_len) for p in req.prompts()]
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        for prompt in prompts:
            self._max_tokens(len(prompt), max_tokens, "max_tokens")
        params = _constrained(
            req.sampling_params(1 if req.prompt_only else max_tokens, req.logprobs), req.output_spec()
        )
        params = _with_prompt_logprobs(params, req.prompt_logprobs, req.logprobs if req.echo else None)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = req.model or self.served_model_name
        echo = {i: self._prompt_text(prompts[i]) for i in range(len(prompts))} if req.echo else {}

        def respond(generation: Generation) -> dict[str, Any]:
            choices = []
            for i, out in sorted(generation.final.items()):
                for c in out.outputs:
                    if req.prompt_only:
                        c = _prompt_only(c)
                    choices.append(
                        CompletionChoice(
                            index=i * req.n + c.index,
                            text=echo.get(i, "") + c.text,
                            logprobs=self._completion_logprobs(req, out, c, echo.get(i)),
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                            prompt_logprobs=self._prompt_logprobs(out, req.prompt_logprobs),
                        )
                    )
            return CompletionResponse(
                id=request_id, created=created, model=model, choices=choices, usage=_completion_usage(generation, req)
            ).model_dump()

        async def stream(generation: Generation) -> AsyncIterator[str]:
            events = ChunkEvents(CompletionChunk(id=request_id, created=created, model=model, choices=[]))
            choices: dict[int, _ChoiceStream] = {}
            async for i, out in generation.outputs():
                for c in out.outputs:
                    index = i * req.n + c.index
                    state = choices.get(index) or choices.setdefault(
                        index, _ChoiceStream(self.logprobs.texts(out.prompt_token_ids, params.skip_special_tokens))
                    )
                    if req.prompt_only:  # the one token sampled is left out: the prompt, once it is scored
                        if not c.finished:
                            continue
                        c = _prompt_only(c)
                    newly_finished = c.finished and not state.finished
                    echoed = None if state.started else echo.get(i)  # the prompt leads the first chunk
                    # A chunk per step that produced tokens, even when they add no text yet (a split
                    # multi-byte character, a held-back stop string prefix), as vLLM does: clients
                    # time the first token by the first chunk.
                    if not echoed and not c.delta_text and not c.delta_token_ids and not newly_finished:
                        continue
                    logprobs = None
                    if req.logprobs is not None:
                        generated = self.logprobs.completion(c, state.texts, len(c.token_ids))
                        logprobs = self._echoed_logprobs(out, echoed, generated, len(echo.get(i, "")), req.logprobs)
                    state.started, state.finished = True, c.finished
                    yield events.event(
                        CompletionStreamChoice(
                            index=index,
                            text=(echoed or "") + c.delta_text,
                            logprobs=logprobs,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                    )
            if req.include_usage:
                yield sse(
                    CompletionChunk(
                        id=request_id,
                        created=created,
                        model=model,
                        choices=[],
                        usage=_completion_usage(generation, req),
                    ).to_json()
                )
            yield SSE_DONE

        return await self._run(
            request, prompts, params, request_id, req.user, respond, stream if req.stream else None, req.priority, lora
        )

    def _completion_logprobs(
        self, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, echoed: str | None
    ) -> CompletionLogprobs | None:
        """A whole choice's logprobs (with ``echo``, the prompt's first)."""
        if req.logprobs is None:
            return None
        generated = self.logprobs.completion(
            c, self.logprobs.texts(out.prompt_token_ids, req.skip_special_tokens), len(c.token_ids)
        )
        return self._echoed_logprobs(out, echoed, generated, len(echoed or ""), req.logprobs)

    def _echoed_logprobs(
        self, out: RequestOutput, echoed: str | None, generated: CompletionLogprobs, echo_len: int, num_top: int
    ) -> CompletionLogprobs:
        """``generated`` behind the echoed prompt's own logprobs (vLLM's order, when ``echoed`` is
        given); generated offsets count from the start of the echoed text."""
        prompt = (
            CompletionLogprobs()
            if echoed is None
            else self.logprobs.prompt(out.prompt_token_ids, out.prompt_logprobs, echoed, True, num_top)
        )
        return CompletionLogprobs(
            tokens=prompt.tokens + generated.tokens,
            token_logprobs=prompt.token_logprobs + generated.token_logprobs,
            top_logprobs=prompt.top_logprobs + generated.top_logprobs,
            text_offset=prompt.text_offset + [echo_len + offset for offset in generated.text_offset],
        )

    def _prompt_logprobs(self, out: RequestOutput, asked: int | None) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` of one prompt, ``asked`` alternatives per position."""
        if asked is None:
            return None
        if out.prompt_logprobs is None:
            raise APIError(500, "the engine returned no prompt logprobs", type="server_error")
        return self.logprobs.prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, asked, MAX_TOP_LOGPROBS)

    def _prompt_text(self, prompt_ids: list[int]) -> str:
        return self.tokenizer.decode(prompt_ids, skip_special_tokens=True)

    # ---- chat ----------------------------------------------------------------------------------
    def render_chat(self, messages: list[ChatMessage], fields: ChatTemplateFields) -> str:
        """The prompt text of ``messages``: the model's chat template (or the request's, where this
        server trusts request templates) with the default variables, the request's
        ``chat_template_kwargs`` over them, and the tools."""
        fields.refuse_bad_template_fields()
        if fields.chat_template is not None and not self.chat_templates.trust_request_chat_template:
            raise bad_request(
                "a request's chat_template runs only on a server started with --trust-request-chat-template",
                "chat_template",
            )
        variables = {**self.template_variables(fields), **template_variables(fields.tool_list)}
        return self.tokenizer.apply_chat_template(
            messages_for_template([m.for_template() for m in messages]),
            add_generation_prompt=fields.add_generation_prompt,
            continue_final_message=fields.continue_final_message,
            chat_template=fields.chat_template,
            **variables,
        )

    def template_variables(self, fields: ChatTemplateFields) -> dict[str, Any]:
        """The template's own variables for a request: the server's defaults, then the request's."""
        return {**self.chat_templates.default_kwargs, **fields.template_kwargs()}

    def reasoning_for(self, fields: ChatTemplateFields) -> ReasoningParser | None:
        """The parser that splits this request's answers; None without one, or when the request
        turned thinking off (the template wrote an empty think block, or none)."""
        if self.reasoning_parser is None or thinking_disabled(self.template_variables(fields)):
            return None
        return self.reasoning_parser

    async def create_chat_completion(self, req: ChatCompletionRequest, request: Request) -> Any:
        lora = self.generation_target(req.model)
        req.refuse_unsupported()
        # the parameters first: their errors do not depend on the model's template
        requested = req.requested_max_tokens
        params = req.sampling_params(1 if requested is None else requested, req.engine_logprobs)
        tools, tool_choice = req.tool_list, req.effective_tool_choice
        forced = tool_choice_spec(tools, tool_choice) if tools else None  # required / named: a grammar
        spec = req.output_spec(forced)
        text = self.render_chat(req.messages, req)
        prompt = req.truncated(
            self.tokenizer.encode(text, add_special_tokens=False),  # the template wrote them
            self.max_model_len,
        )
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        reasoning = self.reasoning_for(req)
        if reasoning is not None and spec is not None:  # the grammar constrains the answer, not the reasoning
            spec = dataclasses.replace(spec, reasoning_gate=reasoning_gate(reasoning, prompt))
        params = dataclasses.replace(
            params, max_tokens=self._max_tokens(len(prompt), requested, param), structured_outputs=spec
        )
        params = _with_prompt_logprobs(params, req.prompt_logprobs, None)
        skip = params.skip_special_tokens
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = req.model or self.served_model_name

        def respond(generation: Generation) -> dict[str, Any]:
            out = generation.final[0]
            choices = []
            reasoning_tokens = 0
            for c in out.outputs:
                text, thought, split = c.text, None, None
                if reasoning is not None:
                    split = reasoning.splitter(out.prompt_token_ids)
                    split.feed(c.token_ids)
                    texts = self.logprobs.texts(out.prompt_token_ids, skip)
                    texts.advance(c)
                    thought, text = split.parts(c.text, texts.ends)
                    reasoning_tokens += split.reasoning_tokens
                message, finish_reason = _assistant_message(text, reply_parser(tools, tool_choice), c.finish_reason)
                if split is not None and split.has_reasoning:
                    message.reasoning_content = thought if req.include_reasoning else None
                    message.content = message.content or None  # nothing after the think block: null, as in vLLM
                choices.append(
                    ChatChoice(
                        index=c.index,
                        message=message,
                        logprobs=self.logprobs.chat(
                            c, self.logprobs.texts(out.prompt_token_ids, skip), len(c.token_ids), skip
                        )
                        if req.logprobs
                        else None,
                        finish_reason=finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
            return ChatCompletionResponse(
                id=request_id,
                created=created,
                model=model,
                choices=choices,
                usage=_with_reasoning_tokens(generation.usage(), reasoning, reasoning_tokens),
                prompt_logprobs=self._prompt_logprobs(out, req.prompt_logprobs),
            ).model_dump()

        async def stream(generation: Generation) -> AsyncIterator[str]:
            chunk = ChunkEvents(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[])).event

            for index in range(req.n):
                yield chunk(
                    ChatStreamChoice(
                        index=index, delta=DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None
                    )
                )
            choices: dict[int, _ChoiceStream] = {}
            async for _, out in generation.outputs():
                for c in out.outputs:
                    state = choices.get(c.index)
                    if state is None:
                        state = choices[c.index] = _ChoiceStream(
                            self.logprobs.texts(out.prompt_token_ids, params.skip_special_tokens),
                            split=None if reasoning is None else reasoning.splitter(out.prompt_token_ids),
                            parser=reply_parser(tools, tool_choice),
                        )
                    newly_finished = c.finished and not state.finished
                    if not c.delta_text and not c.delta_token_ids and not newly_finished:
                        continue
                    logprobs = None
                    if req.logprobs:
                        logprobs = self.logprobs.chat(c, state.texts, len(c.token_ids), skip)
                    state.finished = c.finished
                    thought, text = _split_delta(state, c)
                    delta, finish_reason = _stream_delta(state.parser, text, c.finish_reason, state)
                    if thought and req.include_reasoning:
                        delta.reasoning_content = thought
                    yield chunk(
                        ChatStreamChoice(
                            index=c.index,
                            delta=delta,
                            logprobs=logprobs,
                            finish_reason=finish_reason,
                            stop_reason=c.stop_reason,
                        )
                    )
            if req.include_usage:
                reasoning_tokens = sum(s.split.reasoning_tokens for s in choices.values() if s.split is not None)
                usage = _with_reasoning_tokens(generation.usage(), reasoning, reasoning_tokens)
                yield sse(
                    ChatCompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage).to_json()
                )
            yield SSE_DONE

        return await self._run(
            request, [prompt], params, request_id, req.user, respond, stream if req.stream else None, req.priority, lora
        )


def _with_prompt_logprobs(params: SamplingParams, asked: int | None, echoed: int | None) -> SamplingParams:
    """The engine's ``prompt_logprobs`` for ``asked`` (the request's field) and ``echoed`` (echo
    with logprobs). For ``asked`` the engine ranks the top ``MAX_TOP_LOGPROBS``, so that a prompt
    token's rank is known whenever it is among them; each answer then keeps its own count."""
    if asked is not None:
        return dataclasses.replace(params, prompt_logprobs=MAX_TOP_LOGPROBS)
    if echoed is not None:
        return dataclasses.replace(params, prompt_logprobs=echoed)
    return params


def _prompt_only(c: CompletionOutput) -> CompletionOutput:
    """A choice of a ``max_tokens: 0`` request: the token the engine sampled is left out."""
    return dataclasses.replace(
        c,
        text="",
        delta_text="",
        token_ids=[],
        delta_token_ids=[],
        logprobs=[],
        top_logprobs=None,
        finish_reason="length",
        stop_reason=None,
    )


def _completion_usage(generation: Generation, req: CompletionRequest) -> Usage:
    usage = generation.usage()
    if req.prompt_only:
        usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
    return usage


# ---- structured outputs and tool calls -------------------------------------------------------------
def _constrained(params: SamplingParams, spec: StructuredOutputSpec | None) -> SamplingParams:
    return params if spec is None else dataclasses.replace(params, structured_outputs=spec)


def _with_reasoning_tokens(usage: Usage, reasoning: ReasoningParser | None, tokens: int) -> Usage:
    """``completion_tokens_details.reasoning_tokens``, for a request a reasoning parser split."""
    if reasoning is not None:
        usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=tokens)
    return usage


def _split_delta(state: _ChoiceStream, c: CompletionOutput) -> tuple[str, str]:
    """This chunk's ``(reasoning, answer)`` text: the choice's text so far split at its think
    block's token offsets, minus what was already sent. Without a parser: ``("", delta_text)``."""
    split = state.split
    if split is None:
        return "", c.delta_text
    split.feed(c.token_ids)
    state.texts.advance(c)
    thought, answer = split.parts(c.text, state.texts.ends)
    new_thought, new_answer = thought[state.reasoning_sent :], answer[state.answer_sent :]
    state.reasoning_sent, state.answer_sent = len(thought), len(answer)
    return new_thought, new_answer


def _tool_finish(finish_reason: str | None, made_calls: bool) -> str | None:
    """A reply that ends in tool calls finishes with "tool_calls", as OpenAI's do."""
    return "tool_calls" if made_calls and finish_reason == "stop" else finish_reason


def _assistant_message(
    text: str, parser: ReplyParser | None, finish_reason: str | None
) -> tuple[AssistantMessage, str | None]:
    if parser is None:
        return AssistantMessage(content=text), finish_reason
    parsed = parser.whole(text)
    return (
        AssistantMessage(
            content=parsed.content or (None if parsed.tool_calls else ""), tool_calls=parsed.tool_calls or None
        ),
        _tool_finish(finish_reason, bool(parsed.tool_calls)),
    )


def _stream_delta(
    parser: ReplyParser | None, text: str, finish_reason: str | None, state: _ChoiceStream
) -> tuple[DeltaMessage, str | None]:
    """One chunk's delta: content, and tool-call deltas (a new call's index, id and name; then its
    arguments as they are written)."""
    if parser is None:
        return (DeltaMessage(content=text) if text else DeltaMessage()), finish_reason
    parsed = parser.feed(text)
    if finish_reason is not None:
        end = parser.finish()
        parsed = ParsedDelta(parsed.content + end.content, parsed.tool_calls + end.tool_calls)
    state.sent_tool_calls = state.sent_tool_calls or bool(parsed.tool_calls)
    delta = DeltaMessage(content=parsed.content or None, tool_calls=parsed.tool_calls or None)
    return delta, _tool_finish(finish_reason, state.sent_tool_calls)
