"""Benchmark workloads: what each request asks (prompt, output length, user), reproducible from a seed.

- **random**: prompts of random tokens, input and output lengths drawn uniformly from
  ``[len * (1 - range_ratio), len * (1 + range_ratio)]``.
- **shared-prefix**: ``num_users`` users, each with its own random system prompt of ``prefix_len``
  tokens that starts every one of its requests, followed by a random suffix; the request's ``user``
  is set so the engine's fair scheduler sees the users.
- **sharegpt**: a ShareGPT-format JSON file (a list of ``{"conversations": [{"from": "human" |
  "gpt", "value": ...}, ...]}``): the first human turn is the prompt, the tokenized length of the
  reply that follows it is the output length.

Prompts are token-id lists (exact lengths, what the in-process engine takes) or text (what any
HTTP server takes). Random text is built from tokens that decode to printable text and encode back
to themselves, then trimmed or extended until the tokenizer counts exactly the asked length.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from llmctl.errors import LlmctlError
from llmctl.tokenizer import Tokenizer

DATASETS = ("random", "shared-prefix", "sharegpt")
SHAREGPT_MIN_LEN = 4  # shorter prompts or replies are skipped, as in vLLM's benchmark
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


class DatasetError(LlmctlError):
    """The workload cannot be built as asked (bad file, impossible lengths)."""


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int  # tokens, as the benchmark's tokenizer counts them
    output_len: int  # tokens to ask for (max_tokens)
    user: str | None = None
    lora: str | None = None  # the LoRA adapter it runs with (in process, bench --lora-modules)


class PromptFactory:
    """Random prompts of an exact token length, as token ids or as text."""

    FIT_ATTEMPTS = 32

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int | None = None, as_text: bool = False) -> None:
        if tokenizer is None and (as_text or vocab_size is None):
            raise DatasetError("text prompts need a tokenizer (pass the served model's directory or hub id as MODEL)")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size if vocab_size is not None else tokenizer.vocab_size
        self.as_text = as_text

    @cached_property
    def pool(self) -> list[int]:
        """Token ids that are plain text on their own: no special tokens, no partial UTF-8 bytes."""
        tok = self.tokenizer
        if tok is None:
            return list(range(self.vocab_size))
        special = set(tok.backend.get_added_tokens_decoder()) | tok.eos_token_ids
        pool = []
        for token_id in range(min(self.vocab_size, tok.vocab_size)):
            if token_id in special:
                continue
            text = tok.decode([token_id])
            plain = text and text.isprintable() and "\ufffd" not in text
            if plain and tok.encode(text, add_special_tokens=False) == [token_id]:
                pool.append(token_id)
        if not pool:
            raise DatasetError(f"the tokenizer ({tok.source}) has no plain-text tokens to build prompts from")
        return pool

    @cached_property
    def num_special(self) -> int:
        """Tokens the tokenizer adds to every text (a BOS)."""
        tok = self.tokenizer
        return len(tok.encode("a")) - len(tok.encode("a", add_special_tokens=False)) if tok else 0

    def sample_ids(self, n: int, rng: random.Random) -> list[int]:
        pool = self.pool
        return [pool[rng.randrange(len(pool))] for _ in range(n)]

    def make(self, length: int, rng: random.Random) -> tuple[str | list[int], int]:
        """A prompt of ``length`` tokens and its actual length (text lengths can miss by a token
        or two on tokenizers whose merges refuse to settle)."""
        if not self.as_text:
            return self.sample_ids(length, rng), length
        return self.fit_text(self.sample_ids(max(1, length - self.num_special), rng), length, rng)

    def fit_text(self, ids: list[int], length: int, rng: random.Random, prefix: str = "") -> tuple[str, int]:
        """Decode ``ids`` after ``prefix`` and trim or extend them until ``prefix + text`` encodes to
        ``length`` tokens."""
        tok = self.tokenizer
        best: tuple[int, str, int] | None = None
        for _ in range(self.FIT_ATTEMPTS):
            text = prefix + tok.decode(ids)
            n = len(tok.encode(text))
            if best is None or abs(n - length) < best[0]:
                best = (abs(n - length), text, n)
            if n == length:
                break
            if n > length:
                ids = ids[: max(1, len(ids) - (n - length))]
            else:
                ids = ids + self.sample_ids(length - n, rng)
        return best[1], best[2]


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def check_range_ratio(range_ratio: float) -> None:
    if not 0 <= range_ratio < 1:
        raise DatasetError(f"--range-ratio must be in [0, 1), got {range_ratio}")


def random_requests(
    factory: PromptFactory, num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    check_range_ratio(range_ratio)
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        in_len, out_len = _length(rng, input_len, range_ratio), _length(rng, output_len, range_ratio)
        prompt, actual = factory.make(in_len, rng)
        requests.append(BenchRequest(prompt, actual, out_len))
    return requests


def shared_prefix_requests(
    factory: PromptFactory,
    num_prompts: int,
    num_users: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[BenchRequest]:
    """Request ``i`` belongs to user ``i % num_users``; its prompt is that user's system prompt
    followed by ``input_len`` (± range ratio) random tokens."""
    check_range_ratio(range_ratio)
    if num_users < 1 or prefix_len < 1:
        raise DatasetError("--num-users and --prefix-len must be at least 1")
    rng = random.Random(seed)
    prefixes = [factory.make(prefix_len, rng)[0] for _ in range(num_users)]
    requests = []
    for i in range(num_prompts):
        user = i % num_users
        prefix = prefixes[user]
        suffix_len, out_len = _length(rng, input_len, range_ratio), _length(rng, output_len, range_ratio)
        suffix_ids = factory.sample_ids(suffix_len, rng)
        if isinstance(prefix, list):
            prompt, actual = prefix + suffix_ids, prefix_len + suffix_len
        else:
            prompt, actual = factory.fit_text(
                suffix_ids, len(factory.tokenizer.encode(prefix)) + suffix_len, rng, prefix=prefix
            )
        requests.append(BenchRequest(prompt, actual, out_len, user=f"user-{user}"))
    return requests


_HUMAN = {"human", "user"}
_ASSISTANT = {"gpt", "assistant", "chatgpt", "bard", "model"}


def _first_exchange(conversation: Iterable[dict]) -> tuple[str, str] | None:
    turns = list(conversation)
    for turn, reply in zip(turns, turns[1:]):
        if turn.get("from") in _HUMAN and reply.get("from") in _ASSISTANT:
            prompt, answer = turn.get("value"), reply.get("value")
            if isinstance(prompt, str) and isinstance(answer, str) and prompt and answer:
                return prompt, answer
            return None
    return None


def sharegpt_requests(
    path: Path,
    tokenizer: Tokenizer | None,
    num_prompts: int,
    seed: int,
    output_len: int | None = None,
    max_model_len: int | None = None,
) -> list[BenchRequest]:
    """The first human/assistant exchange of each conversation, shuffled with ``seed``; exchanges
    with a prompt or reply under 4 tokens, a prompt over 1024 or a total over 2048 (or over
    ``max_model_len``) are skipped. ``output_len`` overrides the replies' lengths."""
    if tokenizer is None:
        raise DatasetError("the sharegpt dataset needs a tokenizer to count prompt and reply tokens")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read a ShareGPT JSON file ({exc})") from exc
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of {{'conversations': [...]}} entries")
    exchanges = [
        ex
        for entry in data
        if isinstance(entry, dict)
        and isinstance(entry.get("conversations"), list)
        and (ex := _first_exchange(entry["conversations"])) is not None
    ]
    random.Random(seed).shuffle(exchanges)
    max_total = min(SHAREGPT_MAX_TOTAL_LEN, max_model_len or SHAREGPT_MAX_TOTAL_LEN)
    requests: list[BenchRequest] = []
    for prompt, answer in exchanges:
        if len(requests) == num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt))
        out_len = output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        if prompt_len < SHAREGPT_MIN_LEN or out_len < SHAREGPT_MIN_LEN and output_len is None:
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + out_len > max_total:
            continue
        requests.append(BenchRequest(prompt, prompt_len, out_len))
    if not requests:
        raise DatasetError(f"{path}: no usable human/assistant exchange (see the length limits in docs/bench.md)")
    return requests
