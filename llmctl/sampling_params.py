"""Per-request sampling parameters, validated before the engine allocates anything."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmctl.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    """``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes a request's samples reproducible whatever it is batched with; sample ``i`` of an
    ``n > 1`` request uses ``seed + i``. ``logprobs``: None = none, 0 = the chosen token's only,
    k = also the k most likely alternatives."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # as logprobs, for every prompt token (echo, perplexity)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(message: str) -> None:
            raise InvalidRequestError(message)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            bad(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed <= 2**64 - self.n):
            # sample i is seeded with seed + i, and torch's generators take [-2**63, 2**64)
            bad(f"seed must be an integer in [-2**63, 2**64 - n], got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            bad(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            bad(f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_filtering(self) -> bool:
        return self.top_k > 0 or self.top_p < 1

    def sample_seed(self, index: int) -> int | None:
        return None if self.seed is None else self.seed + index
