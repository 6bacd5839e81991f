"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.distributed import TensorParallel
from llmctl.layers.linear import copy_checked, linear, prepack_for_cpu


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype,
                 tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.size)  # ceil: the last shard may be padded
        self.vocab_start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"expected vocabulary {self.vocab_size}, got shape {tuple(loaded.shape)}")
        part = loaded[self.vocab_start : self.vocab_start + self.shard_size]
        param.data.zero_()
        copy_checked(param.data[: part.shape[0]], part, "embedding")

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Computes each rank's slice of the logits, then gathers the full vocabulary."""

    packed_weight: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        # A separate packed copy: the weight may be tied to the embedding, which needs it plain.
        self.packed_weight = prepack_for_cpu(self.weight.data)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = linear(hidden, self.weight if self.packed_weight is None else self.packed_weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
