"""Tensor- and pipeline-parallel handles passed explicitly to the layers and the model (no global
state): ``TensorParallel`` is this rank's place in its tensor-parallel group, ``PipelineStage`` the
decoder layers this rank's stage runs. Launching ranks lives in ``llmctl.parallel``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False)  # the ProcessGroup of this stage's TP ranks (None: the world)

    @classmethod
    def from_env(cls) -> TensorParallel:
        """The group torchrun set up (``dist.init_process_group`` must have run), else a single rank."""
        if dist.is_available() and dist.is_initialized():
            return cls(rank=dist.get_rank(), size=dist.get_world_size())
        return cls()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def shard(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {self.size}")
        return total // self.size


@dataclass(frozen=True)
class PipelineStage:
    """Decoder layers ``[start, end)`` of ``num_layers``; the first stage embeds the tokens, the
    last one applies the final norm and computes logits. One stage holding every layer is the
    unpipelined model."""

    start: int
    end: int
    num_layers: int

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        return cls(0, num_layers, num_layers)

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.num_layers

    def owns_layer(self, index: int) -> bool:
        return self.start <= index < self.end


def split_layers(num_layers: int, num_stages: int, partition: str | None = None) -> list[PipelineStage]:
    """Contiguous stages, as even as possible (the later stages take the remainder: the first
    stage's rank also schedules and samples), or the explicit ``partition`` "3,2" (layers per stage)."""
    if partition:
        counts = [int(c) for c in partition.split(",")]
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"layer partition {partition!r} must give {num_stages} positive counts summing to "
                f"the model's {num_layers} layers"
            )
    else:
        if num_layers < num_stages:
            raise ValueError(f"{num_layers} layers cannot be split over pipeline-parallel size {num_stages}")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if i >= num_stages - extra else 0) for i in range(num_stages)]
    stages, start = [], 0
    for count in counts:
        stages.append(PipelineStage(start, start + count, num_layers))
        start += count
    return stages
