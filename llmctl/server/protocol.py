"""Request and response bodies of the OpenAI API, as pydantic models, and their mapping to
``SamplingParams``.

Requests accept and ignore OpenAI fields that do not change the output (``metadata``, ``store``,
``parallel_tool_calls``, ...), as vLLM does; fields that would change the output and that llmctl
cannot honour (penalties, ``logit_bias``, tools, JSON modes) are refused with a 400 rather than
silently dropped. vLLM's extra sampling fields (``top_k``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``) are accepted too.

Requests are validated strictly, as OpenAI's API does: a wrong type is a 400, never coerced
(``"stream": "yes"``, ``"max_tokens": "5"``, ``"temperature": true``), NaN and infinities are
refused, and every error names the offending field in ``param``.

Responses are dumped whole, ``null`` fields included, as OpenAI's are; only a stream's ``delta``
drops its unset fields, so it carries just what changed.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from llmctl.errors import InvalidRequestError
from llmctl.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16


class APIError(Exception):
    """An error answered in OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests -----------------------------------------------------------------------------------
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class _Request(BaseModel):
    model_config = STRICT

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator accepts
    user: Optional[str] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    # vLLM's extra sampling parameters
    top_k: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0

    def refuse_unsupported(self) -> None:
        """Refuse parameters that would change the output in ways llmctl does not implement."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise bad_request(f"{name} is not supported by llmctl (only 0 is accepted)", name)
        if self.repetition_penalty not in (None, 1, 1.0):
            raise bad_request("repetition_penalty is not supported by llmctl (only 1 is accepted)",
                              "repetition_penalty")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by llmctl", "logit_bias")
        if self.min_tokens:
            raise bad_request("min_tokens is not supported by llmctl", "min_tokens")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """A 400 naming the field on out-of-range values."""
        try:
            return self._sampling_params(max_tokens, logprobs)
        except InvalidRequestError as exc:  # its message starts with the parameter's name
            name = str(exc).split(" ", 1)[0]
            raise bad_request(str(exc), self.API_NAMES.get(name, name if name in type(self).model_fields else None)) \
                from None

    API_NAMES: ClassVar[dict[str, str]] = {}  # SamplingParams field -> request field, where they differ

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    """``POST /v1/completions``. ``prompt`` is a text, a list of texts, a list of token ids or a list
    of token-id lists; each prompt gets ``n`` choices (choice index = prompt index * n + sample)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported by llmctl (leave it unset or equal to n)", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported by llmctl", "suffix")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs needs prompt logprobs, which llmctl does not compute", "echo")

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class ContentPart(BaseModel):
    model_config = STRICT

    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: text content only."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"content parts of type {part.type!r} are not supported (text only)",
                                      "messages")
                texts.append(part.text)
            content = "".join(texts)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: str = "text"


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``. With no ``max_completion_tokens``/``max_tokens`` the answer may
    use all the context the prompt leaves."""

    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None

    API_NAMES: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs"}

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if not self.messages:
            raise bad_request("messages is empty", "messages")
        if self.tools:
            raise bad_request("tool calling is not supported by llmctl", "tools")
        if self.response_format is not None and self.response_format.type != "text":
            raise bad_request("only response_format type 'text' is supported by llmctl", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses ----------------------------------------------------------------------------------
class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> str:
        return self.model_dump_json()


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionLogprobs(_Response):
    """OpenAI's legacy completions format: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: Optional[list[TokenLogprob]] = None


class AssistantMessage(_Response):
    role: str = "assistant"
    content: Optional[str] = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None


class DeltaMessage(_Response):
    role: Optional[str] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[Usage] = None


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmctl"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
