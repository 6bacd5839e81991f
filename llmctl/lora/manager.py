"""Multi-LoRA serving for one engine: the adapters it knows by name, the device slots they are
copied into, and each step's per-token adapter plan that every adapted projection reads.

A batch mixing base-model requests and several adapters runs one forward: each linear module's
output gets ``(x @ A[slot]^T) @ B[slot]^T * scale`` added for the tokens of an adapter
(``LinearBase.lora``), the tokens grouped by slot once per step (``LoRABatchPlan``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from llmctl.errors import ConfigError, InvalidRequestError
from llmctl.layers.linear import LinearBase
from llmctl.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter
from llmctl.lora.slots import LoRABatch, LoRALinear, LoRASlots
from llmctl.platform import KernelSet
from llmctl_kernels.lora import NO_ADAPTER, LoRAKernel, lora_add_grouped, lora_add_native, per_slice, plan_lora_batch


def lora_kernel(kernels: KernelSet, dtype: torch.dtype) -> LoRAKernel:
    """This engine's LoRA kernel: the Triton kernels with the Triton backend, the native CPU kernel
    where the native CPU kernels run (fp32 or bf16), else the grouped torch GEMMs."""
    if kernels.backend == "triton":
        from llmctl_kernels.lora_triton import BLOCK_M, lora_add_triton

        return LoRAKernel(per_slice(lora_add_triton), transposed=False, block_m=BLOCK_M, name="triton")
    if kernels.native_cpu and dtype in (torch.float32, torch.bfloat16):
        return LoRAKernel(lora_add_native, transposed=True, block_m=16, name=f"native CPU ({kernels.isa})")
    return LoRAKernel(per_slice(lora_add_grouped), transposed=False, block_m=16, name="grouped torch")


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        *,
        max_loras: int,
        max_lora_rank: int,
        kernels: KernelSet,
        dtype: torch.dtype,
    ) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ConfigError("--max-loras and --max-lora-rank must be at least 1")
        self.model, self.max_rank, self.dtype = model, max_lora_rank, dtype
        self.device = kernels.device
        self.kernel = lora_kernel(kernels, dtype)
        self.batch = LoRABatch()
        names, layers = [], []
        for name, module in model.named_modules():
            if isinstance(module, LinearBase):
                module.lora = LoRALinear(module, self.batch, self.kernel, max_loras, max_lora_rank, dtype, self.device)
                names.append(name)
                layers.append(module.lora)
        self.slots = LoRASlots(layers, names, max_loras)
        self.adapters: dict[str, LoRAAdapter] = {}

    # ---- the adapters this engine serves ---------------------------------------------------------
    def add(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read, check and register an adapter (host memory; a slot takes it when a batch needs it)."""
        if not name:
            raise LoRAAdapterError("a LoRA adapter needs a name")
        if name in self.adapters:
            raise LoRAAdapterError(f"LoRA adapter {name!r} is already loaded (from {self.adapters[name].path})")
        adapter = load_adapter(name, path, self.model, self.max_rank, self.dtype)
        self.adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> LoRAAdapter:
        """Forget an adapter; requests already running with it finish with it (its slot is reused
        least-recently-used, as any other: the slots belong to the engine loop's thread)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoRAAdapterError(f"no LoRA adapter named {name!r} is loaded")
        return adapter

    def resolve(self, lora: str | LoRAAdapter) -> LoRAAdapter:
        if isinstance(lora, LoRAAdapter):
            return lora
        adapter = self.adapters.get(lora)
        if adapter is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise InvalidRequestError(f"unknown LoRA adapter {lora!r} (loaded: {known})")
        return adapter

    # ---- one step ------------------------------------------------------------------------------
    def begin_batch(self, rows: Iterable[tuple[LoRAAdapter | None, int]]) -> bool:
        """Set the step's plan from ``(adapter, tokens)`` in batch order, loading adapters into slots
        as needed; returns whether any token has an adapter."""
        rows = list(rows)
        # the slots of the batch's adapters already loaded are kept: loading another never evicts them
        busy = {self.slots.adapter_in.index(a.id) for a, _ in rows if a is not None and a.id in self.slots.adapter_in}
        token_slots: list[int] = []
        for adapter, count in rows:
            slot = NO_ADAPTER
            if adapter is not None:
                slot = self.slots.slot_of(adapter, busy)
                busy.add(slot)
            token_slots += [slot] * count
        self.batch.plan = plan_lora_batch(token_slots, self.device, self.kernel.block_m) if busy else None
        return bool(busy)

    def end_batch(self) -> None:
        self.batch.plan = None

    def describe(self) -> str:
        """For start-up lines."""
        return f"LoRA: {self.slots.num_slots} slots, rank <= {self.max_rank}, {self.kernel.name} kernels"
