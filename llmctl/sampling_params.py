"""Per-request sampling parameters, validated before the engine allocates anything."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmctl.errors import InvalidRequestError
from llmctl.structured.spec import StructuredOutputSpec

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 (ban) .. 100 (force)


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
    # logits processors (vLLM's definitions; see llmctl/engine/logits_processors.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's)
    bad_words: list[str] = field(default_factory=list)  # never generated (vLLM's): the engine tokenizes them
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # set by LLMEngine.add_request from bad_words
    # the output must match this (JSON schema, regex, choice, grammar): enforced while sampling
    structured_outputs: StructuredOutputSpec | None = None

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
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            bad(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            bad(f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        self._validate_logits_processors(bad)

    def _validate_logits_processors(self, bad) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2 <= value <= 2:
                bad(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0 < self.repetition_penalty <= 100:
            bad(f"repetition_penalty must be in (0, 100] (1 = off), got {self.repetition_penalty!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0:
                bad(f"logit_bias keys must be token ids (non-negative integers), got {token!r}")
            if not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                bad(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            bad("allowed_token_ids must be a non-empty list of token ids (non-negative integers)")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            bad("bad_words must be a list of non-empty strings")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputSpec):
            bad("structured_outputs must be a StructuredOutputSpec")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_filtering(self) -> bool:
        return self.top_k > 0 or self.top_p < 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """Anything to do before the temperature: penalties, ``logit_bias``, ``min_tokens``,
        ``allowed_token_ids``, ``bad_words``."""
        return (
            self.has_penalties
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
        )

    def sample_seed(self, index: int) -> int | None:
        return None if self.seed is None else self.seed + index
