"""Batched multi-LoRA: one batch, tokens of many adapters (and of none), one pair of matmuls per
projection instead of one forward per adapter (vLLM's punica kernels, as plain as they go).

For token ``t`` with adapter slot ``s = slot[t]`` (``-1``: the base model, no delta)::

    out[t] += (x[t] @ A[s]^T * scale[s]) @ B[s]^T

Layouts: ``A [slots, rank, in]`` (PEFT's ``lora_A.weight`` per slot, rank zero-padded to the
engine's largest), ``B [slots, out, rank]`` (``lora_B.weight``), ``scale [slots]`` fp32
(``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA). A ``LoRABatchPlan`` is built once per step
from the batch's per-token slots and read by every projection of every layer:

- ``lora_delta_reference``: the oracle, each token's own adapter gathered (memory-hungry, exact);
- ``lora_add_grouped``: the batch's rows grouped by slot, two torch GEMMs per adapter present
  (the expand summed into the output by ``addmm_``): CUDA with the torch backend, or a CPU
  without the native kernels;
- ``lora_add_native``: the CPU kernel (kernels/cpu/lora_kernels.cpp), every slice of a module in
  two parallel regions, from *transposed* stacks (``A^T [slots, in, R]``, ``B^T [slots, R, out]``,
  R rounded up to 16, fp32 or bf16 as the activations); the native decode loop calls the same
  kernel, so both give the same bits;
- ``llmctl_kernels.lora_triton.lora_add_triton``: the same grouping as Triton kernels (CUDA).

A ``LoRAKernel`` names one of them with the layout its stacks are stored in; it adds the deltas of
every adapted slice of a module, ``(offset, size, A, B, scale)`` each, in one call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmctl_kernels.cpu_native import EXTENSION as _CPU_KERNELS

NO_ADAPTER = -1
RANK_ALIGN = 16  # the native kernel's stacks round the rank up to this (zero columns)

# One adapted output slice of a module: (offset, size, A, B, scale) in the kernel's layout.
Stack = tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class LoRABatchPlan:
    """One step's tokens grouped by adapter slot: every kernel path reads it."""

    slots: torch.Tensor  # [tokens] int64, NO_ADAPTER for base-model tokens
    groups: list[tuple[int, slice | torch.Tensor]]  # (slot, its rows: a slice when contiguous)
    order: torch.Tensor  # [adapter tokens] int32: token indices sorted by slot (Triton)
    block_slot: torch.Tensor  # [blocks] int32: each block of ``block_m`` sorted tokens, its slot
    block_start: torch.Tensor  # [blocks] int32: its first position in ``order``
    block_end: torch.Tensor  # [blocks] int32: one past its last position in ``order``
    spans: list[tuple[int, int, int, torch.Tensor | None]]  # native kernels: (slot, start, end, rows or None)

    @property
    def empty(self) -> bool:
        return not self.groups


def plan_lora_batch(token_slots: list[int], device: torch.device, block_m: int = 16) -> LoRABatchPlan:
    """Group a step's tokens by slot (host lists in, device tensors out: built once per step)."""
    rows_of: dict[int, list[int]] = {}
    for t, s in enumerate(token_slots):
        if s != NO_ADAPTER:
            rows_of.setdefault(s, []).append(t)
    groups: list[tuple[int, slice | torch.Tensor]] = []
    order: list[int] = []
    blocks: list[tuple[int, int, int]] = []
    for s in sorted(rows_of):
        rows = rows_of[s]
        contiguous = rows[-1] - rows[0] + 1 == len(rows)
        groups.append((s, slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=device)))
        start = len(order)
        order += rows
        blocks += [(s, b, min(b + block_m, len(order))) for b in range(start, len(order), block_m)]

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return LoRABatchPlan(
        slots=torch.tensor(token_slots, dtype=torch.int64, device=device),
        groups=groups,
        order=ints(order),
        block_slot=ints([b[0] for b in blocks]),
        block_start=ints([b[1] for b in blocks]),
        block_end=ints([b[2] for b in blocks]),
        spans=[(s, rows.start, rows.stop, None) if isinstance(rows, slice) else (s, 0, 0, rows) for s, rows in groups],
    )


def lora_delta_reference(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """``[tokens, out]`` deltas in fp32: each token's adapter gathered, zero where it has none."""
    safe = slots.clamp(min=0)
    xa = torch.einsum("ti,tri->tr", x.float(), a[safe].float())
    delta = torch.einsum("tr,tor->to", xa, b[safe].float()) * scale[safe].float()[:, None]
    return torch.where((slots >= 0)[:, None], delta, torch.zeros_like(delta))


def lora_add_grouped(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, plan: LoRABatchPlan
) -> None:
    """``out += delta`` in place: per adapter in the batch, its rows through ``(x @ A^T * scale) @ B^T``
    (one ``addmm_`` into ``out``)."""
    for s, rows in plan.groups:
        shrunk = x[rows] @ a[s].t()
        shrunk.mul_(scale[s].to(shrunk.dtype))  # on the rank-wide product: the scale costs R, not out, per row
        if isinstance(rows, slice):
            out[rows].addmm_(shrunk.to(out.dtype), b[s].t())  # the expand summed into out by the GEMM itself
        else:  # gathered, summed into, put back (a row never repeats)
            out.index_put_((rows,), out[rows].addmm_(shrunk.to(out.dtype), b[s].t()))


def lora_add_native(out: torch.Tensor, x: torch.Tensor, stacks: list[Stack], plan: LoRABatchPlan) -> None:
    """``out += delta`` in place for every slice in ``stacks`` (transposed stacks in ``x``'s dtype),
    in the CPU kernel the native decode loop calls too. Called per adapted module and step: the
    loaded module is read directly (``NativeKernels.module``), not through its lock."""
    (_CPU_KERNELS.module or _CPU_KERNELS.require()).lora_add(out, x, stacks, plan.spans)


def per_slice(kernel: Callable[..., None]) -> Callable[[torch.Tensor, torch.Tensor, list[Stack], LoRABatchPlan], None]:
    """A one-slice kernel ``(out_slice, x, A, B, scale, plan)`` as a whole-module one."""

    def add(out: torch.Tensor, x: torch.Tensor, stacks: list[Stack], plan: LoRABatchPlan) -> None:
        for offset, size, a, b, scale in stacks:
            kernel(out[:, offset : offset + size], x, a, b, scale, plan)

    return add


@dataclass(frozen=True)
class LoRAKernel:
    """How an engine adds LoRA deltas: ``add(out, x, stacks, plan)`` for one module's slices;
    ``transposed``: its stacks are ``A^T [slots, in, R]`` / ``B^T [slots, R, size]`` with R rounded
    up to ``RANK_ALIGN`` (the native CPU kernel), else ``A [slots, R, in]`` / ``B [slots, size, R]``;
    in the model's dtype either way; ``block_m``: tokens per plan block (Triton)."""

    add: Callable[[torch.Tensor, torch.Tensor, list[Stack], LoRABatchPlan], None]
    transposed: bool
    block_m: int
    name: str
