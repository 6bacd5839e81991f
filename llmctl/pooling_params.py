"""Per-request pooling parameters: a request that runs its prompt's prefill only and returns one
vector (an embedding, or the last position's logits at a few token ids) instead of tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmctl.errors import InvalidRequestError

POOLING_TYPES = ("last", "mean", "cls")


@dataclass
class PoolingParams:
    """``pooling``: which final-norm hidden states make the vector: the last token's (``last``),
    the mean over every prompt token (``mean``) or the first token's (``cls``). ``normalize``: L2
    normalize it. ``dimensions``: keep the first ``dimensions`` components (Matryoshka), then
    normalize if asked. ``logit_token_ids``: instead of a hidden state, the logits of these token
    ids at the last position (a reranker's yes/no scores); ``pooling`` must then be ``last`` and
    nothing is normalized or truncated."""

    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    logit_token_ids: list[int] | None = None
    n: ClassVar[int] = 1  # one output per prompt, as a request with SamplingParams(n=1)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(message: str) -> None:
            raise InvalidRequestError(message)

        if self.pooling not in POOLING_TYPES:
            bad(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            bad(f"normalize must be a boolean, got {self.normalize!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            bad(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        if self.logit_token_ids is not None:
            if not self.logit_token_ids or any(not isinstance(t, int) or t < 0 for t in self.logit_token_ids):
                bad("logit_token_ids must be a non-empty list of token ids (non-negative integers)")
            if self.pooling != "last" or self.dimensions is not None:
                bad("logit_token_ids take the last position's logits: pooling 'last', no dimensions")

    @property
    def needs_every_position(self) -> bool:
        """Mean and first-token pooling read hidden states a prefix-cache hit would skip."""
        return self.pooling in ("mean", "cls")
