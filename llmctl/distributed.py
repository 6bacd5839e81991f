"""Tensor-parallel group handle passed explicitly to the layers that shard (no global state)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    @classmethod
    def from_env(cls) -> TensorParallel:
        """The group torchrun set up (``dist.init_process_group`` must have run), else a single rank."""
        if dist.is_available() and dist.is_initialized():
            return cls(rank=dist.get_rank(), size=dist.get_world_size())
        return cls()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def shard(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {self.size}")
        return total // self.size
