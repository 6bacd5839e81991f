"""Turns the step's logits into one token per sampling sequence.

Greedy rows take the argmax. Sampled rows apply temperature, then top-k and top-p, then draw with
the exponential race (``argmax(p / Exp(1))`` is a draw from ``p``): the noise of a seeded sequence
comes from its own generator, so its tokens do not depend on what it is batched with.

Before that, on the whole batch's tensor: the grammar bitmask of the structured-output rows, then
``min_tokens``, ``logit_bias`` and the penalties (``logits_processors``); ``min_p`` follows the
temperature. Constrained and free rows share the step; a row that asked for nothing is untouched.
Logprobs are those of the model's own distribution (before any of this), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmctl.engine.logits_processors import apply_logits_processors_, apply_min_p_rows_
from llmctl.engine.model_runner import ModelOutput, PromptLogits
from llmctl.engine.sequence import Sequence
from llmctl.structured.manager import StructuredOutputManager


@dataclass
class PromptLogprobs:
    """``SamplingParams.prompt_logprobs`` of one prefill chunk: entry ``i`` is about prompt token
    ``first_index + i`` and holds that token's logprob plus the top-k alternatives."""

    seq: Sequence
    first_index: int
    logprobs: list[dict[int, float]]


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # log-probability of each chosen token under the model
    top_logprobs: list[dict[int, float]] | None
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


class Sampler:
    def __init__(
        self,
        seed: int = 0,
        device: torch.device | str = "cpu",
        eos_token_ids: frozenset[int] = frozenset(),
        structured_outputs: StructuredOutputManager | None = None,
    ) -> None:
        """``structured_outputs``: masks the rows of sequences with a grammar (None: an engine
        without a tokenizer, whose requests cannot have one)."""
        # for unseeded requests; on the logits' device (a CUDA tensor needs a CUDA generator)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.eos_token_ids = eos_token_ids  # what min_tokens holds back
        self.structured_outputs = structured_outputs

    def sample(self, output: ModelOutput, seqs: list[Sequence]) -> SampleResult:
        """One token per sequence from the step's logits, and the prompt logprobs asked for."""
        result = self(output.logits, seqs)
        result.prompt_logprobs = [prompt_logprobs(chunk) for chunk in output.prompt_logits]
        return result

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """``logits``: ``[len(seqs), vocab]`` float32, row ``i`` for ``seqs[i]``."""
        model_logits = logits
        logits = self._adjusted(logits, seqs)
        tokens = logits.max(dim=-1).indices  # max() is ~3x faster than argmax() on CPU
        sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            probs = self._probabilities(logits[rows], [seqs[i] for i in sampled_rows])
            noise = torch.empty_like(probs)
            for j, i in enumerate(sampled_rows):
                noise[j].exponential_(generator=seqs[i].generator or self.generator)
            tokens[rows] = (probs / noise).max(dim=-1).indices
        token_ids = tokens.tolist()

        want = [s.params.logprobs for s in seqs]
        if all(w is None for w in want):
            return SampleResult(token_ids, None, None)
        logprobs = torch.log_softmax(model_logits, dim=-1)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        return SampleResult(token_ids, chosen, top_k_logprobs([w or 0 for w in want], logprobs))

    def distributions(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What ``__call__`` draws from: the adjusted logits (a greedy row takes their argmax) and
        the probabilities of the non-greedy rows, in row order (None when every row is greedy).
        Speculative decoding (llmctl/spec/) draws and accepts tokens by these itself."""
        logits = self._adjusted(logits, seqs)
        sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not sampled_rows:
            return logits, None
        rows = torch.tensor(sampled_rows, device=logits.device)
        return logits, self._probabilities(logits[rows], [seqs[i] for i in sampled_rows])

    def _adjusted(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The logits with grammar masks, min_tokens, logit_bias and penalties applied (a copy when
        logprobs need the model's own)."""
        grammars = [s.grammar for s in seqs]
        constrained = any(g is not None for g in grammars)
        if not constrained and not any(s.params.adjusts_logits for s in seqs):
            return logits
        with torch.inference_mode():  # the model's logits are inference tensors: updated in place here
            if any(s.params.logprobs is not None for s in seqs):
                logits = logits.clone()
            if constrained:
                assert self.structured_outputs is not None, "a sequence has a grammar but the sampler no manager"
                self.structured_outputs.mask_logits_(logits, grammars)
            apply_logits_processors_(logits, seqs, self.eos_token_ids)
        return logits

    @staticmethod
    def _probabilities(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temperature = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
        logits = logits / temperature[:, None]
        if any(s.params.min_p > 0 for s in seqs):
            apply_min_p_rows_(logits, [s.params.min_p for s in seqs])
        if any(s.params.needs_filtering for s in seqs):
            logits = _top_k_top_p(logits, [s.params.top_k for s in seqs], [s.params.top_p for s in seqs])
        return torch.softmax(logits, dim=-1)


def top_k_logprobs(want: list[int], logprobs: torch.Tensor) -> list[dict[int, float]]:
    """Row ``i``'s ``want[i]`` most likely tokens with their logprobs, most likely first."""
    top: list[dict[int, float]] = [{} for _ in want]
    k = max(want, default=0)
    if k > 0:
        values, indices = logprobs.topk(k, dim=-1)
        values, indices = values.tolist(), indices.tolist()
        for i, w in enumerate(want):
            if w:
                top[i] = dict(zip(indices[i][:w], values[i][:w]))
    return top


def prompt_logprobs(chunk: PromptLogits) -> PromptLogprobs:
    """Each prompt token's own logprob (first, as vLLM lists it) plus the top-k alternatives."""
    seq = chunk.seq
    logprobs = torch.log_softmax(chunk.logits, dim=-1)
    targets = seq.token_ids[chunk.first_index : chunk.first_index + logprobs.shape[0]]
    own = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None]).squeeze(1).tolist()
    top = top_k_logprobs([seq.params.prompt_logprobs or 0] * len(targets), logprobs)
    entries = [{token: lp, **alternatives} for token, lp, alternatives in zip(targets, own, top)]
    return PromptLogprobs(seq, chunk.first_index, entries)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus (the top token always stays)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.tensor([t if t > 0 else vocab for t in top_k], device=logits.device)
    mask = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly above each token
    p = torch.tensor([t if t < 1 else 2.0 for t in top_p], device=logits.device, dtype=probs.dtype)
    mask = before >= p[:, None]
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
