"""A sequence: one stream of tokens being generated (a request with ``n`` samples owns ``n``)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from llmctl.pooling_params import PoolingParams
from llmctl.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmctl.lora.adapter import LoRAAdapter
    from llmctl.structured.backend import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"  # turning this request's tokens into output failed; RequestOutput.error says why


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
    stop_reason: int | None = None  # the stop token id that ended it (EOS is not a stop reason)
    # KV state, owned by the block manager: one block table per KV-cache group (group 0: full
    # attention where the model has any; a sliding group's released leading entries are
    # NULL_BLOCK, llmctl/engine/block_manager.py)
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full, cached block
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    pending_forks: int = 0  # siblings to fork off when the prompt's last chunk samples (n > 1)
    generator: torch.Generator | None = None
    grammar: GrammarMatcher | None = None  # structured outputs: where the output stands in its grammar
    # Speculative decoding (llmctl/spec/): this step's draft tokens (set while it is scheduled, cleared
    # when it is booked), the draft model's probabilities for them (None: n-gram drafts, one-hot), and
    # how many leading tokens have K/V in the draft model's pool.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    num_draft_computed: int = 0
    # A pooling request (llmctl/engine/pooler.py): its prompt is prefilled and pooled, never sampled
    # (``params`` is then a placeholder); it ends, and gives its blocks back, when the prefill does.
    pooling: PoolingParams | None = None
    lora: LoRAAdapter | None = None  # the LoRA adapter it runs with (None: the base model)

    def fork(self, index: int) -> Sequence:
        """Sample ``index`` of the same request: the same tokens so far, its own seed (``seed + index``)
        and no blocks yet (the block manager shares the parent's)."""
        child = Sequence(
            self.request_id,
            list(self.token_ids),
            self.num_prompt_tokens,
            self.params,
            user=self.user,
            priority=self.priority,
            arrival_time=self.arrival_time,
            index=index,
            num_cached_tokens=self.num_cached_tokens,
            lora=self.lora,
        )
        seed = self.params.sample_seed(index)
        if seed is not None and self.generator is not None:
            child.generator = torch.Generator(device=self.generator.device).manual_seed(seed)
        if self.grammar is not None:
            child.grammar = self.grammar.copy()
        return child

    @property
    def block_table(self) -> list[int]:
        """Group 0's block table (the only one of a model without sliding windows)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

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
    def needs_prompt_logits(self) -> bool:
        """``prompt_logprobs`` are computed with the prompt, before the first output token; until
        then no prefix-cache hit may skip a prompt position."""
        return self.params.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def needs_every_position(self) -> bool:
        """Its prefill must compute every prompt position (no prefix-cache hit): prompt logprobs,
        or mean / first-token pooling."""
        return self.needs_prompt_logits or (self.pooling is not None and self.pooling.needs_every_position)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
