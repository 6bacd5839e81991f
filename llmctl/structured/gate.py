"""A grammar that starts after the model's think block (structured outputs with reasoning models).

The reasoning is free text; the grammar constrains the answer only, as vLLM applies it. A gated
matcher lets every token through while the output is inside the block and hands over to the
grammar's own matcher from the token after ``</think>``. In the ``undecided`` state (Qwen3: the
answer, unless the first token opens a block) the first token may be ``<think>`` or whatever the
grammar allows; any other first token already belongs to the grammar.
"""

from __future__ import annotations

import torch

from llmctl.structured.backend import CompiledGrammar, GrammarMatcher


class ReasoningGate:
    """A ``GrammarMatcher`` in front of the grammar's matcher: open (the grammar applies) once the
    think block ended."""

    __slots__ = ("inner", "start_id", "end_id", "state", "_log")

    def __init__(self, inner: GrammarMatcher, start_id: int, end_id: int, state: str) -> None:
        self.inner = inner
        self.start_id, self.end_id = start_id, end_id
        self.state = state  # "reasoning" | "undecided" | "open"
        self._log: list[tuple[str, bool]] = []  # per accepted token: the state before, whether the grammar took it

    @property
    def is_open(self) -> bool:
        return self.state == "open"

    def mask_source(self) -> tuple[GrammarMatcher | None, int | None]:
        """``(matcher whose mask applies, or None: every token allowed; a token to allow as well)``."""
        if self.state == "reasoning":
            return None, None
        return self.inner, (self.start_id if self.state == "undecided" else None)

    def accept_token(self, token_id: int) -> bool:
        before = self.state
        if before == "reasoning" or (before == "undecided" and token_id == self.start_id):
            self.state = "open" if before == "reasoning" and token_id == self.end_id else "reasoning"
            self._log.append((before, False))
            return True
        self.state = "open"
        self._log.append((before, True))
        return self.inner.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        inner, extra = self.mask_source()
        if inner is None:
            bitmask[row].fill_(-1)
            return
        inner.fill_bitmask(bitmask, row)
        if extra is not None:
            allow_token_(bitmask, row, extra)

    def rollback(self, num_tokens: int) -> None:
        inner_tokens = 0
        for _ in range(num_tokens):
            self.state, consumed = self._log.pop()
            inner_tokens += consumed
        if inner_tokens:
            self.inner.rollback(inner_tokens)

    def copy(self) -> ReasoningGate:
        twin = ReasoningGate(self.inner.copy(), self.start_id, self.end_id, self.state)
        twin._log = list(self._log)
        return twin

    @property
    def is_terminated(self) -> bool:
        return self.is_open and self.inner.is_terminated

    @property
    def error(self) -> str:
        return self.inner.error


def allow_token_(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set token ``token_id``'s bit in ``bitmask[row]`` (int32 words, bit ``t % 32`` of word ``t // 32``)."""
    word = token_id // 32
    if word >= bitmask.shape[1]:
        return
    value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << (token_id % 32))
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


class GatedGrammar:
    """A compiled grammar whose matchers wait for the end of the think block."""

    def __init__(self, grammar: CompiledGrammar, start_id: int, end_id: int, state: str) -> None:
        self.grammar = grammar
        self.start_id, self.end_id, self.state = start_id, end_id, state

    def new_matcher(self) -> ReasoningGate:
        return ReasoningGate(self.grammar.new_matcher(), self.start_id, self.end_id, self.state)
