"""Device slots for LoRA weights: every linear module gets stacked ``A``/``B`` tensors with one
entry per slot (``max_loras``), into which adapters are copied on demand and from which the
batched kernel gathers each token's adapter. A slot whose adapter no batch token uses is given to
a new adapter least-recently-used first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.layers.linear import LinearBase
from llmctl.lora.adapter import LoRAAdapter, LoRAPart
from llmctl_kernels.lora import RANK_ALIGN, LoRABatchPlan, LoRAKernel, Stack


@dataclass
class LoRABatch:
    """The step's tokens grouped by slot, set by the model runner before each forward and read by
    every adapted projection (None: no token of the step has an adapter)."""

    plan: LoRABatchPlan | None = None


class _PartStack:
    """The slots of one output slice of a module in its kernel's layout: ``A [slots, R, in]``,
    ``B [slots, size, R]``, or transposed with R rounded up (``LoRAKernel.transposed``)."""

    def __init__(
        self,
        offset: int,
        size: int,
        in_features: int,
        slots: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        transposed: bool,
    ) -> None:
        self.offset, self.size, self.transposed = offset, size, transposed
        if transposed:
            rank = -(-rank // RANK_ALIGN) * RANK_ALIGN
            self.a = torch.zeros(slots, in_features, rank, dtype=dtype, device=device)
            self.b = torch.zeros(slots, rank, size, dtype=dtype, device=device)
        else:
            self.a = torch.zeros(slots, rank, in_features, dtype=dtype, device=device)
            self.b = torch.zeros(slots, size, rank, dtype=dtype, device=device)
        self.scale = torch.zeros(slots, dtype=torch.float32, device=device)
        self.filled: set[int] = set()  # slots whose adapter targets this slice

    def put(self, slot: int, part: LoRAPart) -> None:
        rank = part.a.shape[0]
        if self.transposed:
            self.a[slot, :, :rank].copy_(part.a.t())
            self.b[slot, :rank].copy_(part.b.t())
        else:
            self.a[slot, :rank].copy_(part.a)
            self.b[slot, :, :rank].copy_(part.b)


class LoRALinear:
    """Adds the batch's LoRA deltas to one linear module's output (``LinearBase.lora``). A slice's
    stack is allocated when the first adapter targeting it is loaded."""

    def __init__(
        self,
        module: LinearBase,
        batch: LoRABatch,
        kernel: LoRAKernel,
        slots: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.in_features, self.slots, self.rank, self.dtype, self.device = (
            module.in_features, slots, rank, dtype, device
        )  # fmt: skip
        self.stacks: dict[tuple[int, int], _PartStack] = {}  # (offset, size) -> its slots
        self.batch, self.kernel = batch, kernel
        self._bound: list[Stack] = []  # bound_stacks(), as of the last load

    def load(self, slot: int, parts: list[LoRAPart]) -> None:
        """Put an adapter's parts (and their scales) for this module into ``slot``, clearing what was there."""
        for stack in self.stacks.values():
            if slot in stack.filled:
                stack.a[slot].zero_()
                stack.b[slot].zero_()
                stack.scale[slot] = 0.0
                stack.filled.discard(slot)
        for part in parts:
            key = (part.offset, part.size)
            if key not in self.stacks:
                self.stacks[key] = _PartStack(
                    *key, self.in_features, self.slots, self.rank, self.dtype, self.device, self.kernel.transposed
                )
            stack = self.stacks[key]
            stack.put(slot, part)
            stack.scale[slot] = part.scale
            stack.filled.add(slot)
        self._bound = [(s.offset, s.size, s.a, s.b, s.scale) for s in self.stacks.values() if s.filled]

    def bound_stacks(self) -> list[Stack]:
        """``(offset, size, A, B, scale)`` of each slice some slot's adapter targets, in the order
        ``__call__`` adds them: what the native decode loop binds (kernels/cpu/decode_loop.cpp)."""
        return list(self._bound)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        plan = self.batch.plan
        if plan is None or not self._bound:  # no adapter token, or no loaded adapter targets this module
            return out
        if x.shape[0] != plan.slots.numel():
            raise RuntimeError(f"LoRA: a projection saw {x.shape[0]} rows in a batch of {plan.slots.numel()} tokens")
        self.kernel.add(out, x, self._bound, plan)
        return out


class LoRASlots:
    """``max_loras`` device slots shared by every adapted module, assigned least-recently-used."""

    def __init__(self, layers: list[LoRALinear], names: list[str], num_slots: int) -> None:
        self.layers = dict(zip(names, layers))
        self.num_slots = num_slots
        self.adapter_in: list[int | None] = [None] * num_slots  # slot -> adapter id
        self.last_used = [0] * num_slots
        self.clock = 0
        self.loads = 0  # adapters copied into a slot so far

    def slot_of(self, adapter: LoRAAdapter, busy: set[int]) -> int:
        """The slot holding ``adapter``, copying it into the least recently used slot not in ``busy``
        (slots the batch being built uses) when it is not loaded."""
        self.clock += 1
        if adapter.id in self.adapter_in:
            slot = self.adapter_in.index(adapter.id)
        else:
            free = [s for s in range(self.num_slots) if s not in busy]
            if not free:
                raise RuntimeError(f"LoRA: a batch uses more than --max-loras {self.num_slots} adapters")
            slot = min(free, key=lambda s: (self.adapter_in[s] is not None, self.last_used[s]))
            self._load(slot, adapter)
        self.last_used[slot] = self.clock
        return slot

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        for name, layer in self.layers.items():
            layer.load(slot, adapter.modules.get(name, []))
        self.adapter_in[slot] = adapter.id
        self.loads += 1
