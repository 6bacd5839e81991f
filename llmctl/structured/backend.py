"""The one small interface between llmctl and a grammar engine.

A backend compiles a :class:`StructuredOutputSpec` into a grammar once; each constrained sequence
gets its own matcher from it, which accepts the sequence's tokens as they are appended and writes
the next step's allowed tokens into one row of a token bitmask. The bitmask layout is the one both
xgrammar and llguidance use: ``int32 [rows, ceil(vocab / 32)]``, bit ``t % 32`` of word ``t // 32``
set when token ``t`` is allowed. Nothing else in llmctl names the engine, so replacing it means one
new module.
"""

from __future__ import annotations

from typing import Protocol

import torch

from llmctl.structured.spec import StructuredOutputSpec


class GrammarMatcher(Protocol):
    """One sequence's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar forbids it (the matcher is then dead)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (a CPU int32 tensor)."""

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens."""

    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (an ``n > 1`` sample forked off its parent)."""

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and nothing but EOS may follow: the sequence can stop here."""

    @property
    def error(self) -> str:
        """Why the matcher died ('' while it is alive)."""


class CompiledGrammar(Protocol):
    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start; cheap (no recompilation)."""


class GrammarBackend(Protocol):
    @property
    def vocab_size(self) -> int:
        """Columns the bitmask covers: the model's vocabulary (which may exceed the tokenizer's)."""

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """Raises ``InvalidRequestError`` naming the problem for an invalid or unsupported spec.
        May run on a worker thread."""

    def fill_bitmasks(self, matchers: list[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """``fill_bitmask`` for many matchers at once (a backend may do this in parallel)."""
