"""Conversation state of ``llmctl chat`` and the prompt it turns into, with no terminal I/O.

A model with a chat template sees the conversation rendered through that template (the way
``transformers`` renders it), encoded without adding special tokens since the template writes
them. A base model without a template sees one running text instead (system text, then every
user line and every answer, concatenated) and simply continues it.

When the prompt would leave less than ``answer_room`` tokens of the context for the answer, the
oldest turns (a user message and its answer) are dropped for good, the system prompt always kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from llmctl.errors import InvalidRequestError
from llmctl.reasoning import ReasoningParser, thinking_disabled
from llmctl.tokenizer import Tokenizer

Role = Literal["system", "user", "assistant"]
PLAIN_CONTINUATION_NOTICE = "this model has no chat template: plain continuation"


@dataclass(frozen=True)
class Message:
    role: Role
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class PreparedPrompt:
    """What to send for one answer, and how many old messages had to go to make it fit."""

    token_ids: list[int]
    dropped_messages: int


class ChatSession:
    """Messages so far (alternating user/assistant), the system prompt, and prompt building."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        max_tokens: int,
        system_prompt: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        if max_model_len < 2:
            raise InvalidRequestError(f"max_model_len {max_model_len} leaves no room for a conversation")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # Room kept for the answer: all of --max-tokens, but never more than half the context, so a
        # large --max-tokens on a short-context model still leaves room for the conversation.
        self.answer_room = max(1, min(max_tokens, max_model_len // 2))
        self.system_prompt = system_prompt or None
        self.template_kwargs = dict(template_kwargs or {})  # the chat template's own variables (enable_thinking)
        self.messages: list[Message] = []
        self.reasoning = reasoning  # splits a thinking model's answers (None: the model does not think)

    # ---- state ---------------------------------------------------------------------------------
    @property
    def plain_continuation(self) -> bool:
        """True for a base model: no chat template, so the transcript is continued as text."""
        return not self.tokenizer.chat_template

    @property
    def template_switches_thinking(self) -> bool:
        """The chat template reads ``enable_thinking`` (Qwen3): thinking can be turned off there."""
        return "enable_thinking" in (self.tokenizer.chat_template or "")

    @property
    def splitter(self) -> ReasoningParser | None:
        """The parser for the next answer: none when the template variables turned thinking off."""
        return None if thinking_disabled(self.template_kwargs) else self.reasoning

    @property
    def prompt_budget(self) -> int:
        return self.max_model_len - self.answer_room

    @property
    def num_turns(self) -> int:
        return sum(1 for m in self.messages if m.role == "user")

    def set_system(self, text: str | None) -> None:
        """Takes effect from the next answer on; the conversation is kept."""
        self.system_prompt = text or None

    def reset(self) -> None:
        """Forget every message; the system prompt stays."""
        self.messages.clear()

    # ---- one turn ------------------------------------------------------------------------------
    def prepare(self, user_text: str) -> PreparedPrompt:
        """Add the user's message and return the prompt for the answer, dropping the oldest turns
        if needed. Raises ``InvalidRequestError`` (leaving the session as it was) when the message
        cannot fit even alone, or when the chat template refuses the conversation."""
        if self.messages and self.messages[-1].role == "user":
            raise InvalidRequestError("the previous message has no answer yet")
        new = Message("user", user_text)
        alone = self.encode([new], generation_prompt=True)
        if len(alone) > self.prompt_budget:
            raise InvalidRequestError(
                f"this message makes a {len(alone)}-token prompt (with the system prompt and template) but at most "
                f"{self.prompt_budget} fit: max_model_len {self.max_model_len} minus {self.answer_room} kept for the "
                "answer (raise --max-model-len or lower --max-tokens)"
            )
        history = [*self.messages, new]
        dropped = 0
        token_ids = self.encode(history, generation_prompt=True)
        while len(token_ids) > self.prompt_budget:
            cut = 2 if len(history) > 2 and history[1].role == "assistant" else 1
            history = history[cut:]
            dropped += cut
            token_ids = self.encode(history, generation_prompt=True)
        self.messages = history
        return PreparedPrompt(token_ids, dropped)

    def add_answer(self, text: str) -> None:
        if not self.messages or self.messages[-1].role != "user":
            raise InvalidRequestError("an answer needs a user message before it")
        self.messages.append(Message("assistant", text))

    def discard_pending(self) -> None:
        """Drop the last user message if it got no answer (an answer interrupted before any text)."""
        if self.messages and self.messages[-1].role == "user":
            self.messages.pop()

    def context_tokens(self) -> int:
        """Tokens the conversation so far (system prompt included) takes in the next prompt."""
        if not self.messages and not self.system_prompt:
            return 0
        return len(self.encode(self.messages, generation_prompt=False))

    # ---- rendering -----------------------------------------------------------------------------
    def render(self, messages: list[Message], *, generation_prompt: bool) -> str:
        """The prompt text for ``messages`` (the system prompt goes first)."""
        full = ([Message("system", self.system_prompt)] if self.system_prompt else []) + list(messages)
        if self.plain_continuation:
            return plain_transcript(full)
        return self.tokenizer.apply_chat_template(
            [m.as_dict() for m in full], add_generation_prompt=generation_prompt, **self.template_kwargs
        )

    def encode(self, messages: list[Message], *, generation_prompt: bool) -> list[int]:
        text = self.render(messages, generation_prompt=generation_prompt)
        # A template writes its own special tokens; a plain transcript starts like any text (BOS).
        return self.tokenizer.encode(text, add_special_tokens=self.plain_continuation)


def plain_transcript(messages: list[Message]) -> str:
    """Concatenate a conversation for a base model. Answers continue the text exactly; a user line
    is separated from what precedes it by one space when neither side has whitespace there."""
    text = ""
    for message in messages:
        piece = message.content
        if message.role != "assistant" and text and piece and not text[-1].isspace() and not piece[0].isspace():
            text += " "
        text += piece
    return text
