"""Per-request logits adjustments, batched on tensors: penalties, ``logit_bias``, ``min_tokens``, ``min_p``.

The definitions are vLLM's (and OpenAI's for presence/frequency), so a request behaves as it does
there:

- ``repetition_penalty`` (CTRL paper): for every token seen in the prompt or the output so far, a
  positive logit is divided by the penalty and a non-positive one multiplied by it;
- ``frequency_penalty`` subtracts ``penalty * count`` and ``presence_penalty`` subtracts
  ``penalty * (count > 0)``, counting the OUTPUT tokens only;
- ``logit_bias`` is added to the named tokens' logits;
- ``min_tokens``: until that many tokens are out, EOS and the stop token ids are forbidden;
- ``min_p`` (after temperature): tokens whose probability is below ``min_p`` times the most
  likely token's are forbidden;
- ``allowed_token_ids``: every other token is forbidden;
- ``bad_words``: a word's last token is forbidden wherever the output so far ends with the rest of
  it (each word as it starts a text and after a space, tokenized as vLLM tokenizes it).

Order, as in vLLM: grammar mask, allowed_token_ids, bad_words, min_tokens, logit_bias, penalties,
(temperature), min_p, top-k/p.
Every function takes whole-batch tensors and touches only the rows that asked for something; a
batch where nobody did pays one Python check per row.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from collections.abc import Sequence as Seq

import torch

from llmctl.engine.sequence import Sequence


def token_counts(token_lists: Seq[Seq[int]], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[len(token_lists), vocab_size]`` float: how many times each token occurs in each list."""
    longest = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), longest), vocab_size, dtype=torch.int64)
    for row, tokens in enumerate(token_lists):
        padded[row, : len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)  # the last column absorbs padding
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]


def apply_repetition_penalty_(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> None:
    """``seen``: bool ``[rows, vocab]`` (prompt or output); ``penalty``: ``[rows]`` (1 = off)."""
    factor = torch.where(seen, penalty[:, None], torch.ones_like(penalty)[:, None])
    logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))


def apply_frequency_presence_penalties_(
    logits: torch.Tensor, output_counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor
) -> None:
    logits -= frequency[:, None] * output_counts + presence[:, None] * (output_counts > 0)


def apply_logit_bias_(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, biases: torch.Tensor) -> None:
    """Adds ``biases[i]`` to ``logits[rows[i], token_ids[i]]`` (a sparse list of entries)."""
    logits.index_put_((rows, token_ids), biases, accumulate=True)


def forbid_tokens_(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    logits.index_put_((rows, token_ids), torch.tensor(float("-inf"), device=logits.device))


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """``min_p``: ``[rows]`` (0 = off); ``logits`` already divided by the temperature."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    logits.masked_fill_(probs < threshold, float("-inf"))


def _sparse_entries(entries: list[tuple[int, int, float]], device: torch.device) -> tuple[torch.Tensor, ...]:
    rows, tokens, values = zip(*entries)
    return (
        torch.tensor(rows, device=device),
        torch.tensor(tokens, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )


def bad_words_token_ids(encode: Callable[[str], list[int]], words: Seq[str]) -> list[list[int]]:
    """vLLM's tokenization of ``bad_words``: each word as it starts a text, and after a space where
    that gives other tokens of the same count (the word's form inside a sentence)."""
    banned: list[list[int]] = []
    for word in words:
        alone = encode(word.lstrip())
        banned.append(alone)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            banned.append(spaced)
    return banned


def _apply_allowed_and_bad_words(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    vocab = logits.shape[1]
    banned: list[tuple[int, int, float]] = []
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.allowed_token_ids is not None:  # ids below the vocabulary (LLMEngine.add_request checks)
            outside = torch.ones(vocab, dtype=torch.bool, device=logits.device)
            outside[params.allowed_token_ids] = False
            logits[row].masked_fill_(outside, float("-inf"))
        if not params.bad_words_token_ids:
            continue
        output = seq.output_token_ids
        for word in params.bad_words_token_ids:
            prefix = word[:-1]
            if word[-1] < vocab and len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
                banned.append((row, word[-1], 0.0))
    if banned:
        rows, tokens, _ = _sparse_entries(banned, logits.device)
        forbid_tokens_(logits, rows, tokens)


def _grammar_done(seq: Sequence) -> bool:
    """A complete structured output may only end: min_tokens must not forbid its EOS."""
    return seq.grammar is not None and seq.grammar.is_terminated


def _apply_min_tokens_and_bias(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int]) -> None:
    vocab = logits.shape[1]
    forbidden: list[tuple[int, int, float]] = []
    bias: list[tuple[int, int, float]] = []
    for row, seq in enumerate(seqs):
        params = seq.params
        if seq.num_output_tokens < params.min_tokens and not _grammar_done(seq):
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
            forbidden += [(row, t, 0.0) for t in stops if t < vocab]
        if params.logit_bias:
            bias += [(row, t, b) for t, b in params.logit_bias.items() if t < vocab]
    if forbidden:
        rows, tokens, _ = _sparse_entries(forbidden, logits.device)
        forbid_tokens_(logits, rows, tokens)
    if bias:
        apply_logit_bias_(logits, *_sparse_entries(bias, logits.device))


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if not rows:
        return
    vocab, device = logits.shape[1], logits.device
    picked = [seqs[i] for i in rows]
    sub = logits[rows]
    output_counts = token_counts([s.output_token_ids for s in picked], vocab, device)
    repetition = torch.tensor([s.params.repetition_penalty for s in picked], device=device)
    if (repetition != 1).any():
        seen = (token_counts([s.token_ids[: s.num_prompt_tokens] for s in picked], vocab, device) > 0) | (
            output_counts > 0
        )
        apply_repetition_penalty_(sub, seen, repetition)
    frequency = torch.tensor([s.params.frequency_penalty for s in picked], device=device)
    presence = torch.tensor([s.params.presence_penalty for s in picked], device=device)
    apply_frequency_presence_penalties_(sub, output_counts, frequency, presence)
    logits[rows] = sub


def apply_logits_processors_(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int]) -> None:
    """Everything that comes before the temperature, in vLLM's order, in place on ``[len(seqs), vocab]``."""
    _apply_allowed_and_bad_words(logits, seqs)
    _apply_min_tokens_and_bias(logits, seqs, eos_token_ids)
    _apply_penalties(logits, seqs)


def apply_min_p_rows_(logits: torch.Tensor, min_p: list[float]) -> None:
    """``apply_min_p_`` on the rows whose ``min_p`` is set (``logits`` after temperature)."""
    rows = [i for i, p in enumerate(min_p) if p > 0]
    if rows:
        sub = logits[rows]
        apply_min_p_(sub, torch.tensor([min_p[i] for i in rows], device=logits.device))
        logits[rows] = sub
