"""The engine's speculative decoding: who drafts, verification, and the acceptance counters.

One step with speculation::

    Scheduler.schedule: a decode asks ``lookahead`` for k <= --num-speculative-tokens drafts
        (n-gram: proposed right there; draft model: k slots reserved), allocates 1 + k slots and
        charges 1 + k tokens of the budget; it becomes a *verify* (a 1 + k token chunk over its KV)
    Speculator.propose: the draft model fills the verifies' drafts (n-gram: nothing to do)
    ModelRunner.execute: ONE forward for prefills, verifies and plain decodes together
    Speculator.verify: accepted drafts + one token per verify (greedy or rejection sampling)
    Scheduler.update_from_output: appends them up to EOS / stop ids / max_tokens, keeps the K/V of
        the accepted ones, gives the rejected ones' lookahead blocks back
    Speculator.rows: one output row per kept token, for the output processor (stop strings)

Structured-output requests do not speculate (their grammar would have to be advanced over tokens
that may be rejected); they decode one token per step next to those that do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch

from llmctl.config import EngineConfig
from llmctl.engine.block_manager import BlockManager
from llmctl.engine.model_runner import ModelRunner
from llmctl.engine.sampler import Sampler, SampleResult
from llmctl.engine.scheduler import ScheduledSeq, SchedulerOutput
from llmctl.engine.sequence import Sequence
from llmctl.engine.stats import SpecCounters
from llmctl.errors import ConfigError
from llmctl.spec.draft_model import DraftModelProposer
from llmctl.spec.ngram import propose_ngram
from llmctl.spec.verifier import Verified, verify
from llmctl.tokenizer import Tokenizer

NGRAM = "ngram"


class Proposer(Protocol):
    def lookahead(self, seq: Sequence, most: int) -> int: ...
    def propose(self, items: list[ScheduledSeq]) -> None: ...


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def lookahead(self, seq: Sequence, most: int) -> int:
        seq.draft_token_ids = propose_ngram(seq.token_ids, most, self.min_n, self.max_n)
        return len(seq.draft_token_ids)

    def propose(self, items: list[ScheduledSeq]) -> None:
        """Already proposed while scheduling."""


class Speculator:
    def __init__(self, proposer: Proposer, sampler: Sampler, method: str) -> None:
        self.proposer = proposer
        self.sampler = sampler
        self.method = method  # "ngram" or "draft model <name>", for start-up lines and stats
        self.counters = SpecCounters()
        self._tokens_before: list[int] = []

    def lookahead(self, seq: Sequence, most: int) -> int:
        """How many drafts the scheduler should verify behind ``seq``'s pending token."""
        if seq.grammar is not None:  # constrained requests do not speculate (see the module docstring)
            return 0
        return self.proposer.lookahead(seq, most)

    def propose(self, sched: SchedulerOutput) -> None:
        if sched.verifies:
            self.proposer.propose(sched.verifies)

    def verify(self, sched: SchedulerOutput, verify_logits: torch.Tensor) -> Verified:
        self._tokens_before = [item.seq.num_tokens for item in sched.verifies]
        verified = verify(self.sampler, sched.verifies, verify_logits)
        self.counters.num_verifies += len(sched.verifies)
        self.counters.num_drafted += verified.num_drafted
        self.counters.num_accepted += verified.num_accepted
        return verified

    def rows(
        self, sched: SchedulerOutput, sampled: SampleResult, verified: Verified
    ) -> tuple[list[Sequence], SampleResult]:
        """After the scheduler booked the step: the sampling sequences' rows, then one row per
        token each verify kept (fewer than it got when EOS, a stop id or a limit came first)."""
        seqs = list(sched.sampling)
        token_ids = list(sampled.token_ids)
        want = sampled.logprobs is not None or verified.logprobs is not None
        logprobs = list(sampled.logprobs or [0.0] * len(seqs)) if want else None
        top = list(sampled.top_logprobs or [{}] * len(seqs)) if want else None
        for i, (item, before) in enumerate(zip(sched.verifies, self._tokens_before)):
            kept = item.seq.num_tokens - before
            seqs += [item.seq] * kept
            token_ids += verified.token_ids[i][:kept]
            if want:
                logprobs += (verified.logprobs[i] if verified.logprobs else [0.0] * kept)[:kept]
                top += (verified.top_logprobs[i] if verified.top_logprobs else [{}] * kept)[:kept]
        return seqs, dataclasses.replace(sampled, token_ids=token_ids, logprobs=logprobs, top_logprobs=top)


# Loads a model from a config: (model, tokenizer or None, label). The engine's own loader.
LoadModel = Callable[[EngineConfig], tuple[Any, Tokenizer | None, str]]


def build_speculator(
    config: EngineConfig,
    sampler: Sampler,
    block_manager: BlockManager,
    device: torch.device,
    target_vocab_size: int,
    target_tokenizer: Tokenizer | None,
    load_model: LoadModel,
) -> Speculator | None:
    """The engine's speculator from its config (None without ``--speculative-model``). A draft
    model is loaded whole on this rank with ``load_model``, its KV pool addressed by the target's
    ``block_manager``."""
    if config.speculative_model is None:
        return None
    if config.speculative_model == NGRAM:
        proposer: Proposer = NgramProposer(config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max)
        return Speculator(proposer, sampler, NGRAM)
    draft_config = dataclasses.replace(
        config, model=config.speculative_model, model_name=None, tokenizer=None, speculative_model=None
    )
    draft, draft_tokenizer, label = load_model(draft_config)
    _check_vocabulary(target_vocab_size, target_tokenizer, draft, draft_tokenizer, label)
    runner = ModelRunner(
        draft,
        num_blocks=block_manager.num_blocks,
        block_size=config.block_size,
        device=device,
        kv_dtype=draft.model.norm.weight.dtype,
    )
    proposer = DraftModelProposer(runner, sampler, block_manager)
    return Speculator(proposer, sampler, f"draft model {label}")


def _check_vocabulary(
    target_vocab: int, target_tokenizer: Tokenizer | None, draft: Any, draft_tokenizer: Tokenizer | None, label: str
) -> None:
    """A draft's token ids must mean the target's: the same vocabulary, token for token."""
    draft_vocab = draft.config.vocab_size
    if target_vocab != draft_vocab:
        raise ConfigError(
            f"speculative model {label}: its vocabulary has {draft_vocab} tokens, the target's "
            f"{target_vocab}; a draft model must share the target's tokenizer"
        )
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.backend.get_vocab() != draft_tokenizer.backend.get_vocab():
            raise ConfigError(
                f"speculative model {label}: its tokenizer differs from the target's; "
                "a draft model must share the target's tokenizer"
            )
