"""What the engine hands back after each step: per request, the new text and tokens and the totals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None  # the step that produced the newest token
    finished_time: float | None = None
    previous_token_time: float | None = None  # the step before that gave this request a token

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latency(self) -> float | None:
        """Time between this request's two newest tokens (its steps, whatever ``n``)."""
        if self.previous_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.previous_token_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str  # everything generated so far (stop string excluded unless asked for)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (see RequestOutput.error)
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    delta_text: str = ""  # new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    user: str = "default"
    # Set when turning this request's tokens into output failed (detokenizer, stop strings,
    # logprobs): the request alone is finished with finish_reason "error"; the engine goes on.
    error: str | None = None
    # SamplingParams.prompt_logprobs: per prompt position, {token_id: logprob} holding the prompt's
    # own token plus the top-k alternatives; position 0 is None (nothing predicts it), as in vLLM.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # A pooling request's vector (float32, CPU; llmctl/engine/pooler.py): an embedding, or the logits
    # of PoolingParams.logit_token_ids at the last position. Its one output has no tokens.
    pooled: torch.Tensor | None = None
