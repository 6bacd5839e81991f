"""The grammar engine: llguidance (Microsoft's Rust constrained-decoding library, the one OpenAI's
structured outputs credit, and one of vLLM's backends).

Chosen over xgrammar because it has no Python dependencies (xgrammar requires ``transformers`` at
run time, which llmctl keeps test-only, and pins torch), it reads the vocabulary straight from the
``tokenizers`` JSON llmctl already holds (byte-level BPE and SentencePiece byte fallback alike), and
it compiles lazily: a new schema costs about a millisecond rather than a full vocabulary pass, which
matters when every request may bring its own schema. Masks are computed per step (~tens of µs for
JSON) in Rust with the GIL released, in parallel over the batch.
"""

from __future__ import annotations

import logging
import threading

import llguidance
import torch
from tokenizers import Tokenizer as HFTokenizer

from llmctl.errors import InvalidRequestError
from llmctl.structured.spec import StructuredOutputSpec
from llmctl.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Whitespace allowed between JSON tokens, as llama.cpp's JSON grammars allow it: nothing, one space,
# or a line break and up to 20 spaces/tabs of indentation. Enough for compact and pretty-printed
# output, but bounded, so a model (or a noise model) cannot pad an object with whitespace forever.
JSON_WHITESPACE = r"( |\n[ \t]{0,20})?"
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE, "lenient": False}


def build_ll_tokenizer(tokenizer: Tokenizer, vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """The engine's view of the vocabulary: every token's bytes, from ``tokenizer.json``.

    ``vocab_size`` is the model's (embedding rows); ids past the tokenizer's are never allowed."""
    backend = HFTokenizer.from_str(tokenizer.backend.to_str())  # a copy: padding off on it only
    backend.no_padding()
    backend.no_truncation()
    n_vocab = max(vocab_size or 0, tokenizer.vocab_size)
    eos = sorted(tokenizer.eos_token_ids) or None
    try:
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)
    except Exception as exc:  # the Rust side raises a plain exception on vocabularies it cannot read
        raise InvalidRequestError(f"structured outputs cannot use this tokenizer ({tokenizer.source}): {exc}") from exc


def grammar_text(spec: StructuredOutputSpec) -> str:
    """llguidance's grammar for a spec; ValueError for text it cannot even parse."""
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=JSON_OPTIONS)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", spec.text)
    if spec.kind == "grammar":
        return llguidance.grammar_from("grammar", spec.text)  # Lark, or GBNF converted to Lark
    raise InvalidRequestError(f"unknown structured output kind {spec.kind!r}")


class LLGuidanceMatcher:
    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def copy(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._matcher.deep_copy())

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class LLGuidanceGrammar:
    """A compiled grammar: a matcher at the start state, deep-copied for each sequence."""

    def __init__(self, start: llguidance.LLMatcher) -> None:
        self._start = start

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._start.deep_copy())


class LLGuidanceBackend:
    """Reads the vocabulary and starts its thread pool on first use, not when built: an engine builds
    its backend at start-up, and most engines never see a grammar (nor should their threads)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None, num_threads: int | None = None) -> None:
        self._source, self._model_vocab_size = tokenizer, vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._num_threads = num_threads
        self._mask_executor: llguidance.LLExecutor | None = None

    @property
    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is not None:
            return self._ll_tokenizer
        with self._lock:  # compilations run on several threads
            if self._ll_tokenizer is None:
                self._ll_tokenizer = build_ll_tokenizer(self._source, self._model_vocab_size)
            return self._ll_tokenizer

    @property
    def _executor(self) -> llguidance.LLExecutor:
        with self._lock:
            if self._mask_executor is None:
                self._mask_executor = llguidance.LLExecutor(self._num_threads)
            return self._mask_executor

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.vocab_size

    def compile(self, spec: StructuredOutputSpec) -> LLGuidanceGrammar:
        try:
            grammar = grammar_text(spec)
        except ValueError as exc:
            raise InvalidRequestError(f"invalid {spec.kind} for structured output: {exc}") from exc
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise InvalidRequestError(
                f"invalid or unsupported {spec.kind} for structured output: {_one_line(messages[0])}"
            )
        for warning in messages:
            logger.info("structured output %s: %s", spec, warning)
        start = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if start.is_error():
            raise InvalidRequestError(f"invalid {spec.kind} for structured output: {_one_line(start.get_error())}")
        return LLGuidanceGrammar(start)

    def fill_bitmasks(self, matchers: list[tuple[LLGuidanceMatcher, int]], bitmask: torch.Tensor) -> None:
        if not bitmask.is_contiguous() or bitmask.dtype != torch.int32 or bitmask.device.type != "cpu":
            raise ValueError("the bitmask must be a contiguous CPU int32 tensor")
        rows, words = bitmask.shape
        self._executor.unsafe_compute_mask_ptr(
            [(m._matcher, row) for m, row in matchers], bitmask.data_ptr(), words * 4, rows
        )


def _one_line(message: str, limit: int = 300) -> str:
    """llguidance's errors can span lines with a caret under the grammar; a 400 is one line."""
    parts = [line.strip() for line in message.splitlines()]
    text = " ".join(p for p in parts if p and p.strip("^ ") and "|" not in p[:6])
    text = text or "rejected by the grammar engine"
    return text if len(text) <= limit else text[: limit - 3] + "..."
