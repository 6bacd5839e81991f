"""Request and response bodies of the OpenAI API, as pydantic models, and their mapping to
``SamplingParams``.

Requests accept and ignore the OpenAI fields that do not change the output (``metadata``,
``store``, ``service_tier``, ``parallel_tool_calls``, ...; their values are still type-checked);
any other field llmctl does not know is a 400 naming it, as OpenAI's API answers it, and fields
that would change the output and that llmctl cannot honour are refused with a 400 rather than
silently dropped. vLLM's extra sampling fields
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``) and structured-output fields
(``guided_json``/``_regex``/``_choice``/``_grammar``, ``structured_outputs``) are accepted too, and
so are vLLM's ``prompt_logprobs`` (answered in vLLM's format and place) and ``priority``. With a
reasoning parser, chat answers carry vLLM's ``reasoning_content`` (``llmctl/reasoning.py``).

Requests are validated strictly, as OpenAI's API does: a wrong type is a 400, never coerced
(``"stream": "yes"``, ``"max_tokens": "5"``, ``"temperature": true``), NaN and infinities are
refused, and every error names the offending field in ``param``.

Responses are dumped whole, ``null`` fields included, as OpenAI's are; only a stream's ``delta``
drops its unset fields, so it carries just what changed.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from llmctl.errors import InvalidRequestError
from llmctl.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from llmctl.structured.request import spec_from_request
from llmctl.structured.spec import StructuredOutputSpec
from llmctl.tokenizer import TEMPLATE_VARIABLES_SET_BY_LLMCTL

DEFAULT_COMPLETION_MAX_TOKENS = 16


class APIError(Exception):
    """An error answered in OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        ).model_dump()


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests -----------------------------------------------------------------------------------
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
# the Ollama API's: unknown fields ignored, as Ollama's own server ignores them
LENIENT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: str = "text"
    json_schema: dict[str, Any] | None = None


class _Request(BaseModel):
    model_config = STRICT

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator accepts
    user: str | None = None
    keep_alive: str | int | float | None = None  # how long the model stays loaded (llmctl/server/model_manager.py)
    # OpenAI fields that change nothing here: accepted, type-checked, ignored
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float | None = None
    min_tokens: int = 0
    min_p: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    prompt_logprobs: int | None = None  # each prompt token's logprob and the top k alternatives
    priority: int = 0  # the scheduler's order among waiting requests: lower runs earlier, as in vLLM
    # vLLM's fields that would change the output in ways llmctl does not implement: refused, not ignored
    use_beam_search: bool = False
    length_penalty: float = 1.0
    return_tokens_as_token_ids: bool = False
    logits_processors: list[Any] | None = None
    # structured outputs: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        """Refuse parameters that would change the output in ways llmctl does not implement."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if self.truncate_prompt_tokens is not None and (
            self.truncate_prompt_tokens == 0 or self.truncate_prompt_tokens < -1
        ):
            raise bad_request(
                "truncate_prompt_tokens must be a positive token count, or -1 for max_model_len",
                "truncate_prompt_tokens",
            )
        self._refuse_bad_prompt_logprobs()
        unsupported = {
            "use_beam_search": self.use_beam_search,
            "length_penalty": self.length_penalty != 1.0,  # a beam-search setting
            "return_tokens_as_token_ids": self.return_tokens_as_token_ids,
            "logits_processors": bool(self.logits_processors),
        }
        for name, asked in unsupported.items():
            if asked:
                hint = {
                    "length_penalty": " (it belongs to beam search)",
                }.get(name, "")
                raise bad_request(f"{name} is not supported by llmctl{hint}", name)

    def _refuse_bad_prompt_logprobs(self) -> None:
        """vLLM's bounds, except -1 (the whole vocabulary), which is past the engine's top-k cap; and
        with ``stream`` even 0 is refused (vLLM accepts it but sends nothing), as a stream's chunks
        have no place for them."""
        asked = self.prompt_logprobs
        if asked is None:
            return
        if asked == -1:
            raise bad_request(
                f"prompt_logprobs -1 (the whole vocabulary) is not supported by llmctl: at most "
                f"{MAX_TOP_LOGPROBS} alternatives per token",
                "prompt_logprobs",
            )
        if not 0 <= asked <= MAX_TOP_LOGPROBS:
            raise bad_request(f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "prompt_logprobs")
        if self.stream:
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")

    def truncated(self, prompt: list[int], max_model_len: int) -> list[int]:
        """``truncate_prompt_tokens``: the prompt's last k tokens (-1: the last ``max_model_len``)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt
        return prompt[-(max_model_len if keep == -1 else keep) :]

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """A 400 naming the field on out-of-range values."""
        try:
            return self._sampling_params(max_tokens, logprobs)
        except InvalidRequestError as exc:  # its message starts with the parameter's name
            name = str(exc).split(" ", 1)[0]
            raise bad_request(
                str(exc), self.API_NAMES.get(name, name if name in type(self).model_fields else None)
            ) from None

    API_NAMES: ClassVar[dict[str, str]] = {"structured_outputs": "response_format"}  # SamplingParams -> request

    def output_spec(self, tool_choice_spec: StructuredOutputSpec | None = None) -> StructuredOutputSpec | None:
        """The one output constraint the request asks for; a 400 naming the problem otherwise."""
        try:
            return spec_from_request(
                response_format=self.response_format.model_dump() if self.response_format else None,
                guided_json=self.guided_json,
                guided_regex=self.guided_regex,
                guided_choice=self.guided_choice,
                guided_grammar=self.guided_grammar,
                structured_outputs=self.structured_outputs,
                tool_choice_spec=tool_choice_spec,
            )
        except InvalidRequestError as exc:
            raise bad_request(str(exc), "response_format") from None

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise bad_request("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None

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
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._logit_bias(),
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens,
            allowed_token_ids=None if self.allowed_token_ids is None else list(self.allowed_token_ids),
            bad_words=list(self.bad_words or []),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    """``POST /v1/completions``. ``prompt`` is a text, a list of texts, a list of token ids or a list
    of token-id lists; each prompt gets ``n`` choices (choice index = prompt index * n + sample)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported by llmctl (leave it unset or equal to n)", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported by llmctl", "suffix")
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens 0 needs echo: true (it scores the prompt only)", "max_tokens")

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: score the prompt, generate nothing (lm-evaluation-harness's
        loglikelihood requests). The engine still samples one token, which is left out."""
        return self.echo and self.max_tokens == 0

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
    # a part's payload is named by its type (image_url, input_audio, file, ...): only text is read,
    # and any other type is refused by name when the message is rendered
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result answers this call
    reasoning_content: str | None = None  # an assistant's earlier reasoning (templates may show it)
    reasoning: str | None = None  # the same, under vLLM's newer name

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: text content only."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"content parts of type {part.type!r} are not supported (text only)", "messages")
                texts.append(part.text)
            content = "".join(texts)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


class FunctionDefinition(BaseModel):
    model_config = STRICT

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoiceFunction(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: NamedToolChoiceFunction


class ChatTemplateFields(BaseModel):
    """vLLM's fields for how ``messages`` are rendered through the chat template (chat completions
    and ``/tokenize``)."""

    model_config = STRICT

    tools: list[ToolDefinition] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's reasoning effort: the template's ``reasoning_effort`` variable (gpt-oss's templates
    # read it; others ignore it); a chat_template_kwargs entry of that name wins
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """The request's own template variables: ``reasoning_effort``, then ``chat_template_kwargs``."""
        effort = {} if self.reasoning_effort is None else {"reasoning_effort": self.reasoning_effort}
        return {**effort, **(self.chat_template_kwargs or {})}

    @property
    def tool_list(self) -> list[dict[str, Any]]:
        """The tools as plain OpenAI dicts (what chat templates and the tool helpers take)."""
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def refuse_bad_template_fields(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request(
                "continue_final_message needs add_generation_prompt: false (the last message is "
                "continued, not answered)",
                "continue_final_message",
            )
        taken = sorted(set(self.chat_template_kwargs or {}) & set(TEMPLATE_VARIABLES_SET_BY_LLMCTL))
        if taken:
            raise bad_request(
                f"chat_template_kwargs cannot set {', '.join(taken)}: llmctl sets "
                f"{'it' if len(taken) == 1 else 'them'} from the request",
                "chat_template_kwargs",
            )


class ChatCompletionRequest(ChatTemplateFields, _Request):
    """``POST /v1/chat/completions``. With no ``max_completion_tokens``/``max_tokens`` the answer may
    use all the context the prompt leaves."""

    messages: list[ChatMessage]
    echo: bool = False  # vLLM's: the answer prepended with the last message; refused
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    include_reasoning: bool = True  # vLLM's: False leaves reasoning_content out (the split still holds)
    parallel_tool_calls: bool | None = None  # accepted: every call the model writes is returned

    API_NAMES: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs"}

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if not self.messages:
            raise bad_request("messages is empty", "messages")
        if self.echo:
            raise bad_request(
                "echo is not supported by llmctl's chat (continue_final_message continues a message)", "echo"
            )
        if self.tool_choice not in (None, "none") and not self.tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

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


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # with a reasoning parser


class CompletionLogprobs(_Response):
    """OpenAI's legacy completions format: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """vLLM's ``Logprob``: ``rank`` is the token's place in the model's ranking (1: the most
    likely); ``null`` for a prompt token ranked past the engine's top-k cap."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt position, token id (a string in JSON) -> its logprob; the first
# position is null (nothing predicts it), the others hold the prompt's own token and the top k
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionStreamChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionChoice(CompletionStreamChoice):
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class AssistantMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # the think block, with a reasoning parser (vLLM's field)
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's place: the response, not a choice


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmctl"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (as vLLM lists adapters)
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
