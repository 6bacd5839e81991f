"""Compiled grammars for the engine: compiled off the engine loop, cached, one matcher per sequence.

Compilation runs on a small thread pool (llguidance releases the GIL while it builds a grammar),
so a request with a heavy schema never stalls the step of the requests already running. Compiled
grammars are kept in an LRU keyed by the spec; concurrent requests with the same spec share one
compilation (the cache holds futures). A spec that fails to compile is not cached.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from llmctl.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from llmctl.structured.bitmask import allocate_bitmask, apply_bitmask_
from llmctl.structured.gate import GatedGrammar, ReasoningGate, allow_token_
from llmctl.structured.spec import StructuredOutputSpec
from llmctl.tokenizer import Tokenizer

DEFAULT_CACHE_SIZE = 256


class StructuredOutputManager:
    def __init__(self, backend: GrammarBackend, cache_size: int = DEFAULT_CACHE_SIZE, compile_workers: int = 2) -> None:
        self.backend = backend
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredOutputSpec, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=compile_workers, thread_name_prefix="llmctl-grammar")

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Tokenizer, vocab_size: int | None = None, **kwargs: int
    ) -> StructuredOutputManager:
        from llmctl.structured.llguidance_backend import LLGuidanceBackend

        return cls(LLGuidanceBackend(tokenizer, vocab_size), **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    def compile_async(self, spec: StructuredOutputSpec) -> Future[CompiledGrammar]:
        """The compiled grammar, from the cache or compiling on the pool. A failed compilation's
        future raises ``InvalidRequestError`` from ``result()``."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda done: self._forget_failed(spec, done))
        return future

    def _compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        if spec.reasoning_gate is None:
            return self.backend.compile(spec)
        start_id, end_id, state = spec.reasoning_gate
        return GatedGrammar(self.backend.compile(replace(spec, reasoning_gate=None)), start_id, end_id, state)

    def _forget_failed(self, spec: StructuredOutputSpec, future: Future[CompiledGrammar]) -> None:
        if not future.cancelled() and future.exception() is None:
            return
        with self._lock:
            if self._cache.get(spec) is future:
                del self._cache[spec]

    def compile(self, spec: StructuredOutputSpec, timeout: float | None = None) -> CompiledGrammar:
        return self.compile_async(spec).result(timeout)

    def new_matcher(self, spec: StructuredOutputSpec) -> GrammarMatcher:
        return self.compile(spec).new_matcher()

    def cached_specs(self) -> list[StructuredOutputSpec]:
        with self._lock:
            return list(self._cache)

    def bitmask_for(self, matchers: list[GrammarMatcher | None]) -> tuple[torch.Tensor, list[int]] | None:
        """The next-token bitmask of a step's constrained rows: ``(bitmask, rows)`` where
        ``bitmask[i]`` belongs to row ``rows[i]`` of the batch; None when no row is constrained (a
        row still inside its think block is not)."""
        sources: list[GrammarMatcher | None] = []
        also_allowed: dict[int, int] = {}
        for row, matcher in enumerate(matchers):
            if isinstance(matcher, ReasoningGate):
                matcher, extra = matcher.mask_source()
                if extra is not None:
                    also_allowed[row] = extra
            sources.append(matcher)
        rows = [i for i, m in enumerate(sources) if m is not None]
        if not rows:
            return None
        bitmask = allocate_bitmask(len(rows), self.vocab_size)
        self.backend.fill_bitmasks([(sources[row], i) for i, row in enumerate(rows)], bitmask)
        for i, row in enumerate(rows):
            if row in also_allowed:
                allow_token_(bitmask, i, also_allowed[row])
        return bitmask, rows

    def mask_logits_(self, logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> None:
        """Forbid, in place, every token row ``i``'s matcher does not allow (rows without one are free)."""
        found = self.bitmask_for(matchers)
        if found is not None:
            bitmask, rows = found
            apply_bitmask_(logits, bitmask, None if len(rows) == logits.shape[0] else torch.tensor(rows))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
