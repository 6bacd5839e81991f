"""Reasoning output: a thinking model's ``<think>…</think>`` block split from its answer.

The split is made on token ids, never on text: ``<think>`` and ``</think>`` must each be one token of
the vocabulary (an added token), and a generated token is reasoning or answer by where it stands
relative to those ids. The text of each part is then cut out of the choice's own text (the one the
engine's detokenizer produced, stop strings applied) at the offsets where those tokens' text
begins and ends, so reasoning + answer never differ from what the engine generated, apart from the
tags themselves.

Parsers (``--reasoning-parser``):

- ``deepseek_r1``: the output starts inside the reasoning (DeepSeek-R1 templates write ``<think>``
  into the prompt, and older R1 checkpoints never write it at all), unless the prompt's last think
  tag is ``</think>`` (the template closed the block: thinking turned off). A ``<think>`` the model
  writes first is dropped. Everything before the first ``</think>`` is reasoning, everything after
  it the answer.
- ``qwen3``: the output is the answer unless the model writes ``<think>`` (or the prompt's last think
  tag is an open ``<think>``, as Qwen3 thinking-only templates leave it): from there to the first
  ``</think>`` is reasoning. Text before ``<think>`` stays in the answer.
- ``gpt_oss``: OpenAI's harmony format, ``<|channel|>analysis<|message|>…<|end|><|start|>assistant
  <|channel|>final<|message|>…``: the bodies of the ``final`` channel's messages are the answer,
  every other channel's (``analysis``, ``commentary``) the reasoning, one message per line; headers
  (role, channel, ``<|constrain|>``) belong to neither. Output written before any ``<|channel|>``
  (a model that ignores the format) is the answer.
- ``auto``: ``gpt_oss`` for a template that writes ``<|channel|>`` with a harmony vocabulary;
  ``qwen3`` when the chat template mentions ``enable_thinking``, else ``deepseek_r1``; only for a
  template that writes ``<think>`` and a vocabulary where both tags are single tokens, otherwise no
  parser.

For the think-tag parsers: one think block per answer (tags after the first ``</think>`` belong to
the answer); a block that never closes (``max_tokens`` cut it) is all reasoning and the answer is
``None``; an empty answer after a closed block is ``None`` too, as vLLM answers it. A request whose template
variables say ``enable_thinking: false`` (or ``thinking: false``) is not split at all.

Structured outputs start after the block: :func:`reasoning_gate` tells the grammar which token opens
it and whether the output starts inside reasoning (``llmctl/structured``'s ``ReasoningGate``); with
``gpt_oss`` they are refused (the grammar would have to follow the harmony headers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from llmctl.errors import ConfigError, InvalidRequestError
from llmctl.tokenizer import Tokenizer

THINK_START, THINK_END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3", "gpt_oss")
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
CHOICES = (*PARSERS, "auto")
State = Literal["reasoning", "answer", "undecided", "done"]


@dataclass(frozen=True)
class ReasoningParser:
    """The parser a server (or ``llmctl chat``) splits with, bound to one vocabulary."""

    name: str  # "deepseek_r1" | "qwen3" | "gpt_oss"
    start_id: int  # gpt_oss: <|channel|>
    end_id: int  # gpt_oss: <|end|>
    harmony: Harmony | None = None  # gpt_oss: the format's token ids

    def initial_state(self, prompt_token_ids: list[int]) -> State:
        """Where the output starts: inside the reasoning, in the answer, or (``qwen3`` only)
        undecided: the answer unless the first token is ``<think>``."""
        last = _last_tag(prompt_token_ids, self.start_id, self.end_id)
        if last == self.end_id:
            return "answer"  # the template closed the block (thinking turned off)
        if last == self.start_id or self.name == "deepseek_r1":
            return "reasoning"
        return "undecided"

    @property
    def description(self) -> str:
        """The parser and the token ids it splits on, for the server's startup line."""
        if self.harmony is not None:
            h = self.harmony
            return f"{self.name} (<|channel|> {h.channel}, <|message|> {h.message}, <|end|> {h.end})"
        return f"{self.name} ({THINK_START} {self.start_id}, {THINK_END} {self.end_id})"

    def splitter(self, prompt_token_ids: list[int]) -> ReasoningSplit | HarmonySplit:
        if self.harmony is not None:
            return HarmonySplit(self.harmony, prompt_token_ids)
        return ReasoningSplit(self, self.initial_state(prompt_token_ids))


def thinking_disabled(template_variables: dict[str, Any]) -> bool:
    """Qwen3's (``enable_thinking``) and Granite's (``thinking``) switch, turned off."""
    return template_variables.get("enable_thinking") is False or template_variables.get("thinking") is False


def _last_tag(token_ids: list[int], start_id: int, end_id: int) -> int | None:
    for token_id in reversed(token_ids):
        if token_id == start_id or token_id == end_id:
            return token_id
    return None


def _single_token(tokenizer: Tokenizer, text: str) -> int | None:
    token_id = tokenizer.backend.token_to_id(text)
    if token_id is None or token_id not in tokenizer.backend.get_added_tokens_decoder():
        return None
    return token_id


def resolve_parser(name: str | None, tokenizer: Tokenizer | None) -> ReasoningParser | None:
    """``--reasoning-parser NAME`` for this tokenizer. ``auto`` answers None for a model that does
    not think; a named parser on a vocabulary without the tags is a ``ConfigError``."""
    if name is None or tokenizer is None:
        return None
    if name not in CHOICES:
        raise ConfigError(f"--reasoning-parser {name}: unknown (choose from {', '.join(CHOICES)})")
    start_id, end_id = _single_token(tokenizer, THINK_START), _single_token(tokenizer, THINK_END)
    harmony = Harmony.of(tokenizer)
    template = tokenizer.chat_template or ""
    if name == "gpt_oss" or (name == "auto" and harmony is not None and "<|channel|>" in template):
        if harmony is None:
            raise ConfigError(
                f"--reasoning-parser gpt_oss: the vocabulary ({tokenizer.source}) lacks the harmony "
                f"special tokens ({' '.join(HARMONY_TOKENS[:4])}); this is not a gpt-oss model"
            )
        return ReasoningParser("gpt_oss", harmony.channel, harmony.end, harmony)
    if name == "auto":
        if start_id is None or end_id is None or THINK_START not in template:
            return None
        name = "qwen3" if "enable_thinking" in template else "deepseek_r1"
    elif start_id is None or end_id is None:
        raise ConfigError(
            f"--reasoning-parser {name}: the vocabulary ({tokenizer.source}) has no single-token "
            f"{THINK_START} and {THINK_END}; this model does not write think blocks"
        )
    return ReasoningParser(name, start_id, end_id)


@dataclass
class ReasoningSplit:
    """One choice's output, followed token by token: which generated tokens are reasoning.

    ``feed`` takes the choice's token ids so far; ``parts`` cuts its text (with ``ends[i]`` the end
    of token ``i``'s text in it, as ``server.logprobs.TokenTexts`` finds them) into reasoning and
    answer. Both only ever grow, so a stream sends ``parts`` minus what it sent before."""

    parser: ReasoningParser
    state: State
    seen: int = 0  # token ids read so far
    reasoning_from: int | None = None  # first token of the reasoning (after a dropped <think>)
    reasoning_to: int | None = None  # index of the closing </think>
    answer_before: int | None = None  # index of a <think> opened after answer text (qwen3)
    _first: bool = field(default=True, repr=False)

    def feed(self, token_ids: list[int]) -> None:
        for i in range(self.seen, len(token_ids)):
            token = token_ids[i]
            if self.state == "undecided":
                self.state = "answer"
                if token == self.parser.start_id:
                    self.state, self.reasoning_from = "reasoning", i + 1
                    continue
            if self.state == "reasoning":
                if self.reasoning_from is None:
                    # a <think> written first (the model repeats the template's) is dropped
                    self.reasoning_from = i + 1 if token == self.parser.start_id else i
                if token == self.parser.end_id:
                    self.reasoning_to = i
                    self.state = "done"
            elif (
                self.state == "answer"
                and self.parser.name == "qwen3"
                and token == self.parser.start_id
                and self.answer_before is None
                and self.reasoning_from is None
            ):
                self.answer_before, self.reasoning_from, self.state = i, i + 1, "reasoning"
        self.seen = len(token_ids)

    @property
    def ended(self) -> bool:
        """The block closed: what follows is the answer (and a grammar applies to it)."""
        return self.reasoning_to is not None

    @property
    def has_reasoning(self) -> bool:
        return self.reasoning_from is not None

    @property
    def reasoning_tokens(self) -> int:
        """Tokens the think block took, its tags included (what ``usage`` reports)."""
        if self.reasoning_from is None:
            return 0
        opened = self.answer_before if self.answer_before is not None else 0
        closed = self.reasoning_to + 1 if self.reasoning_to is not None else self.seen
        return closed - opened

    def parts(self, text: str, ends: list[int]) -> tuple[str, str]:
        """``(reasoning, answer)`` cut out of ``text`` by token offsets (``ends[i]``: where token
        ``i``'s text ends; a text cut short by a stop string is respected)."""

        def begin(i: int) -> int:  # where token i's text begins
            return min(ends[i - 1] if i > 0 else 0, len(text))

        def finish(i: int) -> int:  # where token i's text ends
            return min(ends[i], len(text)) if i < len(ends) else len(text)

        if self.reasoning_from is None:
            return "", text
        head = text[: begin(self.answer_before)] if self.answer_before is not None else ""
        start = begin(self.reasoning_from) if self.reasoning_from < len(ends) else len(text)
        if self.reasoning_to is None:
            return text[start:], head
        return text[start : begin(self.reasoning_to)], head + text[finish(self.reasoning_to) :]


def reasoning_gate(parser: ReasoningParser, prompt_token_ids: list[int]) -> tuple[int, int, str] | None:
    """What a structured-output grammar needs to start after the think block: ``(start_id, end_id,
    initial state)``, or None when the output starts in the answer (the grammar applies at once)."""
    if parser.harmony is not None:
        raise InvalidRequestError(
            "structured outputs are not supported with the gpt_oss reasoning parser (the grammar "
            "cannot follow harmony's channel headers); send the request without response_format, "
            "or serve without --reasoning-parser"
        )
    state = parser.initial_state(prompt_token_ids)
    return None if state == "answer" else (parser.start_id, parser.end_id, state)


@dataclass(frozen=True)
class Harmony:
    """The harmony format's token ids, and the ``final`` channel's name as the vocabulary spells it."""

    start: int
    channel: int
    message: int
    end: int
    stops: frozenset[int]  # <|end|>, <|return|>, <|call|>: a message's body ends
    final: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> Harmony | None:
        ids = [_single_token(tokenizer, token) for token in HARMONY_TOKENS]
        if any(token_id is None for token_id in ids):
            return None
        start, channel, message, end, return_, call = ids
        final = tuple(tokenizer.encode("final", add_special_tokens=False))
        return cls(start, channel, message, end, frozenset({end, return_, call}), final)  # type: ignore[arg-type]


Mode = Literal["plain", "role", "header", "body"]


@dataclass
class HarmonySplit:
    """One choice's harmony output, followed token by token: which tokens are message bodies, and
    of which channel. The same interface as :class:`ReasoningSplit`.

    The mode the output starts in is read from the prompt's tail (a template that opens the
    assistant's header, ``<|start|>assistant``, leaves it in ``role``)."""

    harmony: Harmony
    prompt_token_ids: list[int]
    seen: int = 0
    mode: Mode = "plain"
    header: list[int] = field(default_factory=list)  # the channel's tokens read so far
    spans: list[tuple[bool, int, int | None]] = field(default_factory=list)  # (is answer, first, end)
    plain_to: int | None = None  # where text written before any <|channel|> ends
    reasoning_to: int = 0  # tokens up to the end of the last reasoning message

    def __post_init__(self) -> None:
        tail = self.prompt_token_ids
        for i in range(len(tail) - 1, -1, -1):
            if tail[i] in (self.harmony.start, *self.harmony.stops):
                tail = tail[i:]
                break
        else:
            tail = []
        for token in tail:
            self._step(token, None)
        if self.mode in ("header", "body"):  # the template opened a header or a body: no plain text
            self.plain_to = 0

    def _step(self, token: int, index: int | None) -> None:
        h = self.harmony
        if token == h.channel:
            if self.plain_to is None and index is not None:
                self.plain_to = index
            self.mode, self.header = "header", []
        elif token == h.start:
            if self.plain_to is None and index is not None:
                self.plain_to = index
            self.mode, self.header = "role", []
        elif token == h.message and self.mode in ("header", "role"):
            answer = tuple(self.header[: len(h.final)]) == h.final
            self.mode = "body"
            self.spans.append((answer, 0 if index is None else index + 1, None))
        elif token in h.stops and self.mode == "body":
            is_answer, first, _ = self.spans[-1]
            self.spans[-1] = (is_answer, first, index)
            self.mode, self.header = "role", []
            if not is_answer and index is not None:
                self.reasoning_to = index + 1
        elif self.mode == "header":
            self.header.append(token)

    def feed(self, token_ids: list[int]) -> None:
        for i in range(self.seen, len(token_ids)):
            self._step(token_ids[i], i)
        self.seen = len(token_ids)

    @property
    def ended(self) -> bool:
        """The final channel's body began."""
        return any(is_answer for is_answer, _, _ in self.spans)

    @property
    def has_reasoning(self) -> bool:
        return any(not is_answer for is_answer, _, _ in self.spans)

    @property
    def reasoning_tokens(self) -> int:
        """Tokens up to the end of the last reasoning message (its headers included), or to the end
        of the output while a reasoning message is still open."""
        if self.spans and not self.spans[-1][0] and self.spans[-1][2] is None:
            return self.seen
        return self.reasoning_to

    def parts(self, text: str, ends: list[int]) -> tuple[str, str]:
        """``(reasoning, answer)`` cut out of ``text`` by token offsets, as ``ReasoningSplit.parts``."""

        def begin(i: int) -> int:
            return min(ends[i - 1] if i > 0 else 0, len(text)) if i <= len(ends) else len(text)

        reasoning: list[str] = []
        answer: list[str] = [text if self.plain_to is None and not self.spans else text[: begin(self.plain_to or 0)]]
        for is_answer, first, last in self.spans:
            body = text[begin(first) : len(text) if last is None else begin(last)]
            (answer if is_answer else reasoning).append(body)
        return "\n".join(reasoning), "".join(answer)


class TokenOffsets:
    """Where each generated token's text ends in the choice's text, from the same streaming
    detokenizer the engine runs (``server.logprobs.TokenTexts`` does the same for logprobs)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._detokenizer = tokenizer.decode_stream(prompt_token_ids, skip_special_tokens)
        self.ends: list[int] = []
        self._length = 0
        self._flushed = False

    def advance(self, token_ids: list[int], finished: bool) -> None:
        for token_id in token_ids[len(self.ends) :]:
            self._length += len(self._detokenizer.step(token_id))
            self.ends.append(self._length)
        if finished and not self._flushed and self.ends:
            self._flushed = True
            self._length += len(self._detokenizer.flush())
            self.ends[-1] = self._length


class ReasoningStream:
    """One streamed answer split as it comes: ``feed`` takes the choice's text and token ids so far
    and gives the new ``(reasoning, answer)`` text."""

    def __init__(
        self,
        parser: ReasoningParser,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.split = parser.splitter(prompt_token_ids)
        self.offsets = TokenOffsets(tokenizer, prompt_token_ids, skip_special_tokens)
        self.reasoning = ""
        self.answer = ""

    def feed(self, text: str, token_ids: list[int], finished: bool) -> tuple[str, str]:
        self.split.feed(token_ids)
        self.offsets.advance(token_ids, finished)
        reasoning, answer = self.split.parts(text, self.offsets.ends)
        new = reasoning[len(self.reasoning) :], answer[len(self.answer) :]
        self.reasoning, self.answer = reasoning, answer
        return new
