"""A sequence: one stream of tokens being generated (a request with ``n`` samples owns ``n``)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from llmctl.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    user: str = "default"
    priority: int = 0
    arrival_time: float = 0.0
    index: int = 0  # which of the request's n samples
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    # KV state, owned by the block manager
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full, cached block
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    pending_forks: int = 0  # siblings to fork off once the prompt is computed (n > 1)
    generator: torch.Generator | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose K/V still have to be computed before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_pending_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
