"""Verification of a step's draft tokens from the logits of the one batched forward that scored them.

A verify's ``k + 1`` logits rows predict the tokens after its pending token and after each draft.
Row ``j`` is processed exactly as the sampler would process it had drafts ``0..j-1`` already been
generated (penalties and ``min_tokens`` see them), then the drafts are accepted greedily or by
rejection sampling (rejection.py). Logprobs are the model's own, as the sampler reports them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from llmctl.engine.sampler import Sampler, top_k_logprobs
from llmctl.engine.scheduler import ScheduledSeq
from llmctl.engine.sequence import Sequence
from llmctl.spec.rejection import accept_greedy, accept_sampled


@dataclass
class Verified:
    """Per verify, in ``SchedulerOutput.verifies`` order: the tokens it gets (accepted drafts, then
    one more) and, where logprobs were asked for, theirs."""

    token_ids: list[list[int]]
    logprobs: list[list[float]] | None
    top_logprobs: list[list[dict[int, float]]] | None
    num_drafted: int
    num_accepted: int


def as_if_appended(seq: Sequence, extra: list[int]) -> Sequence:
    """A stand-in for ``seq`` with ``extra`` tokens generated, for the logits processors that count
    tokens (the sequence itself is not touched)."""
    if not extra or not seq.params.adjusts_logits:
        return seq
    proxy = copy.copy(seq)
    proxy.token_ids = seq.token_ids + extra
    return proxy


def verify(sampler: Sampler, items: list[ScheduledSeq], logits: torch.Tensor) -> Verified:
    """``logits``: ``[sum(num_new_tokens), vocab]`` float32, the verifies' rows in order."""
    drafts = [item.seq.draft_token_ids[: item.num_spec_tokens] for item in items]
    row_seqs = [as_if_appended(item.seq, d[:j]) for item, d in zip(items, drafts) for j in range(len(d) + 1)]
    adjusted, probs = sampler.distributions(logits, row_seqs)
    argmax = adjusted.max(dim=-1).indices.tolist()
    tokens: list[list[int]] = []
    row = sampled = 0
    for item, d in zip(items, drafts):
        seq, rows = item.seq, len(d) + 1
        if seq.params.greedy:
            tokens.append(accept_greedy(d, argmax[row : row + rows]))
        else:
            generator = seq.generator or sampler.generator
            tokens.append(accept_sampled(d, probs[sampled : sampled + rows], seq.draft_probs, generator))
            sampled += rows
        row += rows
    logprobs, top = _logprobs(items, logits, tokens)
    num_drafted = sum(len(d) for d in drafts)
    return Verified(tokens, logprobs, top, num_drafted, sum(len(t) - 1 for t in tokens))


def _logprobs(
    items: list[ScheduledSeq], logits: torch.Tensor, tokens: list[list[int]]
) -> tuple[list[list[float]] | None, list[list[dict[int, float]]] | None]:
    if all(item.seq.params.logprobs is None for item in items):
        return None, None
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen_rows, chosen_tokens, want = [], [], []
    row = 0
    for item, kept in zip(items, tokens):
        chosen_rows += range(row, row + len(kept))
        chosen_tokens += kept
        want += [item.seq.params.logprobs or 0] * len(kept)
        row += item.num_new_tokens
    picked = logprobs[torch.tensor(chosen_rows, device=logits.device)]
    chosen = picked.gather(1, torch.tensor(chosen_tokens, device=logits.device)[:, None]).squeeze(1).tolist()
    top = top_k_logprobs(want, picked)
    out_lp, out_top, at = [], [], 0
    for kept in tokens:
        out_lp.append(chosen[at : at + len(kept)])
        out_top.append(top[at : at + len(kept)])
        at += len(kept)
    return out_lp, out_top
