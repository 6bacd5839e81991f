"""Speculative rejection sampling (Leviathan et al. 2023; vLLM's rejection sampler).

Draft token ``d_j`` drawn from the draft distribution ``q_j`` is accepted with probability
``min(1, p_j(d_j) / q_j(d_j))`` under the target distribution ``p_j``; at the first rejection the
token is drawn from the normalised residual ``max(0, p_j - q_j)`` and the rest are dropped; when
every draft is accepted a bonus token is drawn from ``p_k``. Each emitted token is then distributed
exactly as the target alone would have drawn it. N-gram drafts are deterministic: ``q`` is one-hot,
so acceptance is ``p_j(d_j)`` and the residual is ``p_j`` without ``d_j``.

Greedy rows need none of this: a draft is kept while it equals the target's argmax, which makes the
output token-for-token the output without speculation.
"""

from __future__ import annotations

import torch


def accept_greedy(draft_token_ids: list[int], target_token_ids: list[int]) -> list[int]:
    """``target_token_ids``: the argmax at each of the ``k + 1`` positions. The kept drafts, then
    the target's token at the first mismatch (or the bonus one)."""
    accepted = 0
    while accepted < len(draft_token_ids) and draft_token_ids[accepted] == target_token_ids[accepted]:
        accepted += 1
    return draft_token_ids[:accepted] + [target_token_ids[accepted]]


def accept_sampled(
    draft_token_ids: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor | None, generator: torch.Generator
) -> list[int]:
    """``target_probs``: ``[k + 1, vocab]``; ``draft_probs``: ``[k, vocab]`` or None (one-hot drafts).
    Returns the accepted drafts followed by one token drawn from the residual or the bonus row."""
    k = len(draft_token_ids)
    if k:
        drafts = torch.tensor(draft_token_ids, device=target_probs.device)
        p = target_probs[:k].gather(1, drafts[:, None]).squeeze(1)
        q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(1, drafts[:, None]).squeeze(1)
        uniform = torch.rand(k, generator=generator, device=target_probs.device)
        rejected = (uniform * q >= p).nonzero()
        if len(rejected):
            j = int(rejected[0])
            if draft_probs is None:
                residual = target_probs[j].clone()
                residual[draft_token_ids[j]] = 0
            else:
                residual = (target_probs[j] - draft_probs[j]).clamp_(min=0)
            if residual.sum() <= 0:  # p == q: nothing left over, p itself is the right law
                residual = target_probs[j]
            return draft_token_ids[:j] + [_draw(residual, generator)]
    return draft_token_ids + [_draw(target_probs[k], generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(weights / weights.sum(), 1, generator=generator))
