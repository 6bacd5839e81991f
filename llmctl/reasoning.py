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
- ``auto``: ``qwen3`` when the chat template mentions ``enable_thinking``, else ``deepseek_r1``; only
  for a template that writes ``<think>`` and a vocabulary where both tags are single tokens,
  otherwise no parser.

For both: one think block per answer (tags after the first ``</think>`` belong to the answer); a
block that never closes (``max_tokens`` cut it) is all reasoning and the answer is ``None``; an
empty answer after a closed block is ``None`` too, as vLLM answers it. A request whose template
variables say ``enable_thinking: false`` (or ``thinking: false``) is not split at all.

Structured outputs start after the block: :func:`reasoning_gate` tells the grammar which token opens
it and whether the output starts inside reasoning (``llmctl/structured``'s ``ReasoningGate``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from llmctl.errors import ConfigError
from llmctl.tokenizer import Tokenizer

THINK_START, THINK_END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")
CHOICES = (*PARSERS, "auto")
State = Literal["reasoning", "answer", "undecided", "done"]


@dataclass(frozen=True)
class ReasoningParser:
    """The parser a server (or ``llmctl chat``) splits with, bound to one vocabulary."""

    name: str  # "deepseek_r1" | "qwen3"
    start_id: int
    end_id: int

    def initial_state(self, prompt_token_ids: list[int]) -> State:
        """Where the output starts: inside the reasoning, in the answer, or (``qwen3`` only)
        undecided: the answer unless the first token is ``<think>``."""
        last = _last_tag(prompt_token_ids, self.start_id, self.end_id)
        if last == self.end_id:
            return "answer"  # the template closed the block (thinking turned off)
        if last == self.start_id or self.name == "deepseek_r1":
            return "reasoning"
        return "undecided"

    def splitter(self, prompt_token_ids: list[int]) -> ReasoningSplit:
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
    if name == "auto":
        template = tokenizer.chat_template or ""
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
    state = parser.initial_state(prompt_token_ids)
    return None if state == "answer" else (parser.start_id, parser.end_id, state)


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
