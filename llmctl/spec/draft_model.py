"""A small draft model proposing ``k`` tokens per sequence, autoregressively, on its own KV pool.

The pool has the target's block count and is addressed through the target's block tables (vLLM
v0's design), so the scheduler's allocation serves both models: the lookahead blocks it reserves
for the verify also hold the draft's K/V for its proposals. Each sequence records how many of its
leading tokens have draft K/V (``num_draft_computed``); a proposal first catches the draft up to
the pending token (a prompt, a preempted and resumed sequence, the tokens of the last verify), then
decodes ``k - 1`` more tokens one at a time. Positions past what the target kept are rewritten
before they are read, as in the target's pool. The draft's K/V only steers proposals: a stale or
shared block can cost acceptance, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.model_runner import ModelRunner
from llmctl.engine.sampler import Sampler
from llmctl.engine.scheduler import ScheduledSeq, SchedulerOutput
from llmctl.engine.sequence import Sequence
from llmctl.spec.verifier import as_if_appended


@dataclass(eq=False)
class _DraftView:
    """What the model runner reads of a sequence, as the draft model sees it."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    draft_token_ids: list[int] = field(default_factory=list)
    needs_prompt_logits: bool = False
    num_prompt_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, sampler: Sampler, block_manager: BlockManager) -> None:
        self.runner = runner
        self.sampler = sampler
        self.block_manager = block_manager

    def lookahead(self, seq: Sequence, most: int) -> int:
        """The draft can always propose: reserve ``most`` slots; ``propose`` fills them."""
        return most

    def propose(self, items: list[ScheduledSeq]) -> None:
        """Set each verify's ``draft_token_ids`` (and ``draft_probs`` for sampled sequences)."""
        seqs = [item.seq for item in items]
        ks = [item.num_spec_tokens for item in items]
        views = [
            _DraftView(list(s.token_ids), min(s.num_draft_computed, s.num_computed_tokens), s.block_table) for s in seqs
        ]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(max(ks)):
            active = [i for i, k in enumerate(ks) if k > step]
            logits = self._forward([views[i] for i in active])
            row_seqs = [as_if_appended(seqs[i], drafts[i]) for i in active]
            adjusted, sampled_probs = self.sampler.distributions(logits, row_seqs)
            argmax = adjusted.max(dim=-1).indices.tolist()
            sampled = 0
            for row, i in enumerate(active):
                if seqs[i].params.greedy:
                    token = argmax[row]
                else:
                    q = sampled_probs[sampled]
                    sampled += 1
                    token = int(torch.multinomial(q, 1, generator=seqs[i].generator or self.sampler.generator))
                    probs[i].append(q)
                drafts[i].append(token)
                views[i].num_computed_tokens = views[i].num_tokens
                views[i].token_ids.append(token)
        for seq, view, d, q in zip(seqs, views, drafts, probs):
            seq.draft_token_ids = d
            seq.draft_probs = torch.stack(q) if q else None
            seq.num_draft_computed = view.num_computed_tokens

    def _forward(self, views: list[_DraftView]) -> torch.Tensor:
        """One draft forward: each view's uncomputed tokens (a chunk, or one token); the logits of
        each view's last position, in ``views`` order."""
        chunks = [ScheduledSeq(v, v.num_tokens - v.num_computed_tokens) for v in views]  # type: ignore[arg-type]
        prefills = [c for c in chunks if c.num_new_tokens > 1]
        decodes = [c for c in chunks if c.num_new_tokens == 1]
        order = prefills + decodes
        sched = SchedulerOutput(
            prefills=prefills, decodes=decodes, num_blocks_touched=self.block_manager.num_blocks_touched
        )
        sched.sampling = [c.seq for c in order]
        sched.logits_rows = list(range(len(order)))
        logits = self.runner.execute(sched).logits
        position = {id(c.seq): row for row, c in enumerate(order)}
        return logits[torch.tensor([position[id(v)] for v in views], device=logits.device)]
