"""The Ollama API: ``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/embeddings``,
``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``.

``/api/chat`` is a chat request; ``/api/generate`` one too (``system`` and ``prompt`` as the system
and user messages), unless it is ``raw`` or the model has no chat template (Ollama's default
template is the prompt itself): then the prompt goes to the completions path as it is. Answers
stream as NDJSON by default (``stream: false`` for one object), the last object with ``done``,
``done_reason`` and the durations in nanoseconds. ``options`` map onto the sampler
(:data:`SAMPLER_OPTIONS`); options about loading and hardware, which a loaded server cannot change,
are accepted and ignored (:data:`IGNORED_OPTIONS`), and sampler settings it does not have are
refused unless they are at their neutral value. ``format`` is structured output (``"json"`` or a
JSON schema); ``think`` splits the reasoning into ``thinking`` with the server's reasoning parser.
``/api/embed`` (and the older ``/api/embeddings``, one ``prompt``) runs the inputs as pooling
requests (``llmctl/server/embeddings.py``): the server's pooling, the same vectors as
``/v1/embeddings``; ``truncate`` (default true) cuts an input to the context length as Ollama does,
false refuses it; ``dimensions`` is Matryoshka shortening, as on ``/v1/embeddings``; sampler
``options`` do not apply and are ignored. Errors are Ollama's ``{"error": "..."}``.

``/api/chat`` and ``/api/generate`` take a LoRA adapter's name as ``model`` and run that adapter, as
the OpenAI routes do (:func:`generation_target`); the other routes serve the base model alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from llmctl.config import QUANTIZED_AT_LOAD
from llmctl.layers.quantization import weight_bytes
from llmctl.server.dialects.bridge import ChatRun, Reply, client_gone, parse, renamed
from llmctl.server.embeddings import EmbeddingRequest, PoolingServing
from llmctl.server.protocol import LENIENT, APIError, ChatCompletionRequest, CompletionRequest, bad_request
from llmctl.server.serving import OpenAIServing
from llmctl.structured.tool_calls import merge_calls

# the Ollama API version these answers follow (clients read it to know that think, format
# schemas and tools are understood)
API_VERSION = "0.12.0"
NS = 1_000_000_000
# option -> the OpenAI field it sets
SAMPLER_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "num_predict": "max_completion_tokens",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# set when Ollama loads a model, gone from llama.cpp's sampler, or read only with mirostat (which
# must be 0 here): nothing to do for a loaded server
IGNORED_OPTIONS = {
    "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
    "use_mmap", "use_mlock", "embedding_only", "num_thread", "numa", "num_keep", "penalize_newline",
    "tfs_z", "mirostat_tau", "mirostat_eta",
}  # fmt: skip
# sampler settings llmctl does not have: accepted at their neutral value only
NEUTRAL_OPTIONS = {"mirostat": 0, "typical_p": 1.0}
OPENAI_NAMES = {
    "max_completion_tokens": "num_predict",
    "max_tokens": "num_predict",
    "repetition_penalty": "repeat_penalty",
}


def owns(path: str) -> bool:
    return path == "/api" or path.startswith("/api/")


def error_body(exc: APIError) -> dict[str, Any]:
    return {"error": exc.message}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


# ---- requests -----------------------------------------------------------------------------------
class Function(BaseModel):
    model_config = LENIENT

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(BaseModel):
    model_config = LENIENT

    function: Function


class Message(BaseModel):
    model_config = LENIENT

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


class _Request(BaseModel):
    model_config = LENIENT

    model: str
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None  # the model stays loaded for the server's life
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatRequest(_Request):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Request):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[Any] | None = None


class EmbedRequest(BaseModel):
    model_config = LENIENT

    model: str
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None  # sampler settings: nothing to sample
    keep_alive: str | int | float | None = None


class LegacyEmbeddingsRequest(BaseModel):
    model_config = LENIENT

    model: str
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class ShowRequest(BaseModel):
    model_config = LENIENT

    model: str | None = None
    name: str | None = None  # the older field
    verbose: bool = False


def check_model(serving: OpenAIServing, model: str | None) -> None:
    """The served name (``NAME:latest`` too: Ollama's default tag); a LoRA adapter's name is refused
    by name (the routes that check this serve the base model alone); 404 in Ollama's words otherwise."""
    if model is None:
        raise bad_request("model is required", "model")
    if model.removesuffix(":latest") in serving.model_aliases or model in serving.model_aliases:
        return
    if model.removesuffix(":latest") in serving.lora_names():
        raise bad_request(f"'{model}' is a LoRA adapter: adapters serve /api/chat and /api/generate", "model")
    raise _not_found(serving, model)


def _not_found(serving: OpenAIServing, model: str) -> APIError:
    return APIError(
        404, f"model '{model}' not found (this server serves '{serving.served_model_name}')", code="model_not_found"
    )


def generation_target(serving: OpenAIServing, model: str | None) -> str | None:
    """The LoRA adapter a chat or generate request runs (None: the base model), resolved by
    ``OpenAIServing.generation_target`` as on the OpenAI routes, Ollama's ``:latest`` tag allowed;
    404 in Ollama's words for a name that is neither."""
    if model is None:
        raise bad_request("model is required", "model")
    for candidate in dict.fromkeys((model, model.removesuffix(":latest"))):
        try:
            return serving.generation_target(candidate)
        except APIError:
            continue
    raise _not_found(serving, model)


def _options(options: dict[str, Any] | None) -> dict[str, Any]:
    """``options`` as OpenAI sampling fields; unknown keys are ignored, as Ollama ignores them."""
    fields: dict[str, Any] = {}
    options = options or {}
    for name, value in options.items():
        if value is None:
            continue
        if name in NEUTRAL_OPTIONS and value != NEUTRAL_OPTIONS[name]:
            raise bad_request(
                f"option {name}={value!r} is not supported: llmctl's sampler has no {name} "
                f"(leave it out or {NEUTRAL_OPTIONS[name]!r})",
                name,
            )
        if name not in SAMPLER_OPTIONS:
            continue
        if name == "num_predict":
            if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -2:
                raise bad_request("option num_predict must be a positive token count, -1 or -2 (no limit)", name)
            if value < 0:
                continue  # as much as the context leaves
        if name == "stop" and isinstance(value, str):
            value = [value]
        fields[SAMPLER_OPTIONS[name]] = value
    last_n = options.get("repeat_last_n")
    penalised = any(options.get(n) not in (None, 0, 0.0) for n in ("presence_penalty", "frequency_penalty")) or (
        options.get("repeat_penalty") not in (None, 1, 1.0)
    )
    if last_n == 0:  # Ollama: the penalties are off
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            fields.pop(name, None)
    elif last_n not in (None, -1) and penalised:
        raise bad_request(
            f"option repeat_last_n={last_n!r} is not supported: llmctl's penalties read the whole text "
            "(repeat_penalty: the prompt and the output; presence and frequency penalties: the output), "
            "not a window of the last n tokens; use -1 (the whole context) or leave it out",
            "repeat_last_n",
        )
    return fields


def _format(value: str | dict[str, Any] | None) -> dict[str, Any]:
    if value in (None, ""):
        return {}
    if value == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(value, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}}
    raise bad_request(f'format must be "json" or a JSON schema, got {value!r}', "format")


def _refuse_unsupported(req: _Request) -> None:
    if req.logprobs or req.top_logprobs:
        raise bad_request("logprobs are not supported on the Ollama API here (use /v1/chat/completions)", "logprobs")


def _thinking(serving: OpenAIServing, req: _Request) -> dict[str, Any]:
    """``think`` as template variables: false turns thinking off; a level is ``reasoning_effort``."""
    if req.think is False:
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if req.think is None:
        return {}
    if serving.reasoning_parser is None:
        raise bad_request(
            f"'{req.model}' does not support thinking: this server splits no reasoning "
            "(start it with --reasoning-parser)",
            "think",
        )
    return {"reasoning_effort": req.think} if isinstance(req.think, str) else {}


def _chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        if m.images:
            raise bad_request(f"messages[{i}]: images are not supported: this server runs a text-only model", "images")
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.thinking is not None:
            message["reasoning_content"] = m.thinking
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{i}_{j}",
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)},
                }
                for j, c in enumerate(m.tool_calls)
            ]
        if m.tool_name is not None:
            message["name"] = m.tool_name
        out.append(message)
    return out


def _openai_body(serving: OpenAIServing, req: _Request) -> dict[str, Any]:
    model = generation_target(serving, req.model)
    _refuse_unsupported(req)
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        **_options(req.options),
        **_format(req.format),
    }


# ---- answers ------------------------------------------------------------------------------------
def _done_reason(reply_finish: str | None) -> str:
    return "length" if reply_finish == "length" else "stop"


def _final(run: ChatRun, model: str, finish_reason: str | None) -> dict[str, Any]:
    ended = run.ended or time.monotonic()
    usage = run.usage
    return {
        "model": model,
        "created_at": _now(),
        "done": True,
        "done_reason": _done_reason(finish_reason),
        "total_duration": int((ended - run.started) * NS),
        "load_duration": 0,  # the model was loaded when the server started
        "prompt_eval_count": usage.get("prompt_tokens", 0),
        "prompt_eval_duration": int((run.first - run.started) * NS),
        "eval_count": usage.get("completion_tokens", 0),
        "eval_duration": int((ended - run.first) * NS),
    }


def _ollama_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for call in calls:
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"]) if function["arguments"].strip() else {}
        except json.JSONDecodeError:
            arguments = {}  # cut short by num_predict (done_reason "length")
        out.append({"function": {"name": function["name"], "arguments": arguments}})
    return out


def _ndjson(data: dict[str, Any]) -> str:
    return json.dumps(data) + "\n"


async def _answer(
    run: ChatRun, request: Request, model: str, stream: bool, kind: Literal["chat", "generate"]
) -> Response:
    """The run's answer as Ollama's chat or generate objects, streamed or whole."""

    def body(content: str, thinking: str | None, calls: list[dict[str, Any]] | None) -> dict[str, Any]:
        if kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = _ollama_calls(calls)
            return {"message": message}
        return {"response": content, **({"thinking": thinking} if thinking else {})}

    if not stream:
        reply: Reply | None = await run.reply(request)
        if reply is None:
            return client_gone()
        final = _final(run, model, reply.finish_reason)
        return JSONResponse({**final, **body(reply.content, reply.reasoning, reply.tool_calls)})

    async def lines() -> AsyncIterator[str]:
        deltas: list[dict[str, Any]] = []
        finish_reason = None
        try:
            async for piece in run.pieces():
                deltas.extend(piece.tool_calls)
                if piece.finish_reason is not None:
                    finish_reason = piece.finish_reason
                if piece.content or piece.reasoning:
                    yield _ndjson(
                        {
                            "model": model,
                            "created_at": _now(),
                            **body(piece.content, piece.reasoning, None),
                            "done": False,
                        }
                    )
        except APIError as exc:
            yield _ndjson(error_body(exc))
            return
        if deltas:  # Ollama sends a call whole, once it is complete
            yield _ndjson({"model": model, "created_at": _now(), **body("", None, merge_calls(deltas)), "done": False})
        yield _ndjson({**_final(run, model, finish_reason), **body("", None, None)})

    return run.streaming(lines(), media_type="application/x-ndjson")


def _loaded(model: str, kind: Literal["chat", "generate"]) -> JSONResponse:
    """Ollama's answer to a request with nothing to generate: the model is loaded (it always is)."""
    body = {"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""}
    return JSONResponse({"model": model, "created_at": _now(), **body, "done": True, "done_reason": "load"})


async def _start(
    serving: OpenAIServing, req: ChatCompletionRequest | CompletionRequest, request: Request
) -> ChatRun | Response:
    try:
        return await ChatRun.start(serving, req, request)
    except APIError as exc:
        raise renamed(exc, OPENAI_NAMES) from None


async def chat(serving: OpenAIServing, raw: bytes, request: Request) -> Response:
    req = parse(raw, ChatRequest)
    body = _openai_body(serving, req)
    if not req.messages:
        return _loaded(req.model, "chat")
    body |= {"messages": _chat_messages(req.messages), **_thinking(serving, req)}
    if req.tools:
        body["tools"] = req.tools
    run = await _start(serving, parse(body, ChatCompletionRequest), request)
    if not isinstance(run, ChatRun):
        return run
    return await _answer(run, request, req.model, req.stream, "chat")


async def generate(serving: OpenAIServing, raw: bytes, request: Request) -> Response:
    req = parse(raw, GenerateRequest)
    body = _openai_body(serving, req)
    if req.images:
        raise bad_request("images are not supported: this server runs a text-only model", "images")
    if req.suffix:
        raise bad_request("suffix (fill in the middle) is not supported", "suffix")
    if req.template:
        raise bad_request(
            "template is not supported: prompts are rendered with the model's chat template (or use raw: true)",
            "template",
        )
    if req.context:
        raise bad_request(
            "context is not supported (Ollama deprecated it): send the conversation to /api/chat", "context"
        )
    if not req.prompt:
        return _loaded(req.model, "generate")
    templated = not req.raw and bool(serving.tokenizer.chat_template)
    if not templated:
        if req.system is not None:
            reason = "raw: true" if req.raw else "this model has no chat template"
            raise bad_request(f"system cannot be placed in the prompt ({reason})", "system")
        if req.think:
            raise bad_request("think needs the chat template (not raw: true)", "think")
        if "max_completion_tokens" in body:
            body["max_tokens"] = body.pop("max_completion_tokens")
        else:
            body["max_tokens"] = max(serving.max_model_len - len(serving.tokenizer.encode(req.prompt)), 1)
        completion = parse({**body, "prompt": req.prompt}, CompletionRequest)
        run = await _start(serving, completion, request)
    else:
        messages = ([{"role": "system", "content": req.system}] if req.system is not None else []) + [
            {"role": "user", "content": req.prompt}
        ]
        body |= {"messages": messages, **_thinking(serving, req)}
        run = await _start(serving, parse(body, ChatCompletionRequest), request)
    if not isinstance(run, ChatRun):
        return run
    return await _answer(run, request, req.model, req.stream, "generate")


# ---- models -------------------------------------------------------------------------------------
class ModelInfo:
    """What ``/api/tags``, ``/api/show`` and ``/api/ps`` say about the served model."""

    def __init__(self, serving: OpenAIServing) -> None:
        engine = serving.async_engine.engine
        config = engine.model.config
        self.name = serving.served_model_name
        self.family = config.family
        self.architecture = config.architecture
        self.context_length = serving.max_model_len
        self.size = weight_bytes(engine.model)
        self.size_vram = self.size if engine.device.type != "cpu" else 0
        parameters = sum(p.numel() for p in engine.model.parameters())
        self.parameter_size = f"{parameters / 1e9:.1f}B" if parameters >= 1e9 else f"{parameters / 1e6:.1f}M"
        kind = engine.config.quantization
        self.quantization = kind if kind in QUANTIZED_AT_LOAD else str(engine.dtype).removeprefix("torch.")
        self.modified_at = (
            datetime.fromtimestamp(serving.state.started, timezone.utc).isoformat().replace("+00:00", "Z")
        )
        self.template = serving.tokenizer.chat_template or ""
        self.capabilities = [
            "completion",
            *(["tools"] if self.template else []),
            *(["thinking"] if serving.reasoning_parser else []),
        ]

    def details(self) -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": "llmctl",
            "family": self.family,
            "families": [self.family],
            "parameter_size": self.parameter_size,
            "quantization_level": self.quantization,
        }

    def tag(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.name,
            "modified_at": self.modified_at,
            "size": self.size,
            "digest": "",
            "details": self.details(),
        }

    def show(self) -> dict[str, Any]:
        return {
            "modelfile": "",
            "parameters": "",
            "template": self.template,
            "details": self.details(),
            "model_info": {
                "general.architecture": self.architecture,
                f"{self.family}.context_length": self.context_length,
            },
            "capabilities": self.capabilities,
            "modified_at": self.modified_at,
        }

    def running(self) -> dict[str, Any]:
        return {
            **self.tag(),
            "expires_at": "9999-12-31T23:59:59Z",  # loaded until the server stops
            "size_vram": self.size_vram,
            "context_length": self.context_length,
        }


def show(serving: OpenAIServing, info: ModelInfo, raw: bytes) -> dict[str, Any]:
    req = parse(raw, ShowRequest)
    check_model(serving, req.model or req.name)
    return info.show()


# ---- embeddings ---------------------------------------------------------------------------------
def _embedding_inputs(pooling: PoolingServing, texts: list[str], truncate: bool) -> list[list[int]]:
    """Each text's token ids, cut to the context length when ``truncate`` (longer ones are refused
    by the pooling path otherwise)."""
    if not texts:
        raise bad_request("input is an empty list", "input")
    inputs = []
    for i, text in enumerate(texts):
        if not text:
            raise bad_request(f"input[{i}] is an empty string", "input")
        ids = pooling.serving.tokenizer.encode(text)
        inputs.append(ids[: pooling.serving.max_model_len] if truncate else ids)
    return inputs


async def _embed_ids(
    pooling: PoolingServing, model: str, inputs: list[list[int]], dimensions: int | None, request: Request
) -> tuple[list[list[float]], int]:
    check_model(pooling.serving, model)
    body = EmbeddingRequest(input=inputs, dimensions=dimensions)
    answer = await pooling.embeddings(body, request)
    return [item["embedding"] for item in answer["data"]], answer["usage"]["prompt_tokens"]


async def embed(pooling: PoolingServing, req: EmbedRequest, request: Request) -> dict[str, Any]:
    """``/api/embed``: one vector per input, with Ollama's counts and durations."""
    started = time.monotonic()
    texts = [req.input] if isinstance(req.input, str) else req.input
    inputs = _embedding_inputs(pooling, texts, req.truncate)
    vectors, prompt_tokens = await _embed_ids(pooling, req.model, inputs, req.dimensions, request)
    return {
        "model": req.model,
        "embeddings": vectors,
        "total_duration": int((time.monotonic() - started) * NS),
        "load_duration": 0,
        "prompt_eval_count": prompt_tokens,
    }


async def legacy_embeddings(pooling: PoolingServing, req: LegacyEmbeddingsRequest, request: Request) -> dict[str, Any]:
    """``/api/embeddings``: one ``prompt``, one ``embedding`` (empty for an empty prompt, as Ollama
    answers it)."""
    check_model(pooling.serving, req.model)
    if not req.prompt:
        return {"embedding": []}
    inputs = _embedding_inputs(pooling, [req.prompt], truncate=True)
    vectors, _ = await _embed_ids(pooling, req.model, inputs, None, request)
    return {"embedding": vectors[0]}
