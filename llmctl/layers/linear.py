"""Linear layers that know how they are sharded and how their weights are stored.

Sharding (tensor parallelism): a ``ColumnParallelLinear`` splits its output features across
ranks, a ``RowParallelLinear`` splits its input features and all-reduces the partial sums.
Storage (quantization): every layer delegates weight creation and the matmul to a
``LinearMethod``; the default stores a plain ``[out, in]`` weight. A quantized method swaps in
without touching model code, because checkpoint tensors always arrive through
``param.weight_loader(param, loaded, shard_id)``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.distributed import TensorParallel
from llmctl.platform import native_gemm


class LinearMethod(Protocol):
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None: ...

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


# fp32 weights with at least this many elements (LM heads, wide MLP projections) are prepacked for
# oneDNN when the native panel GEMM is off. Measured on a 2-core Zen 3 (AVX2), CPU time of one thread
# (docs/benchmarks.md): the 576 x 49,152 LM head at batch 1 9.0 -> 7.1 ms; at batch 64 the 1,024 x
# 32,000 LM head 90 -> 71 ms and the 1,024 x 5,632 gate-up 15.8 -> 11.8 ms; but smaller matrices at
# batch 1 are slower prepacked (576 x 960: 58 -> 85 µs, 576 x 3,072: 211 -> 255 µs) and 1,024 x
# 1,536 at batch 64 too.
FP32_PREPACK_MIN_ELEMENTS = 1 << 22


def prepack_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in a layout that a CPU kernel multiplies faster, or None where none applies.

    fp32: packed once into panels of 16 output columns (``[ceil(N/16), K, 16]``,
    kernels/fp32_linear.py) for the native GEMM, where it is wanted and built; each output is then
    summed in k order by fused multiply-adds, so a row's result is bitwise independent of its batch.
    Otherwise (and for bf16) oneDNN's blocked layout: ``F.linear`` re-lays the weight out for
    oneDNN's kernels (AMX/AVX-512/AVX2) on every call; prepacking once makes bf16 decode-sized
    matmuls about a third faster, and large fp32 ones (``FP32_PREPACK_MIN_ELEMENTS``) 20-30 %
    faster. The products are the same; only the summation order differs, within float rounding
    (the exactness tests against ``transformers`` run with it)."""
    if weight.device.type != "cpu":
        return None
    if weight.dtype == torch.float32 and native_gemm() is not None:  # where it runs: llmctl/platform.py
        from llmctl_kernels.fp32_linear import pack_panels

        return pack_panels(weight)
    if not torch.backends.mkldnn.is_available():
        return None
    if not (
        weight.dtype == torch.bfloat16
        or (weight.dtype == torch.float32 and weight.numel() >= FP32_PREPACK_MIN_ELEMENTS)
    ):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except (RuntimeError, AttributeError):  # a torch build without oneDNN's linear ops
        return None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out_features: int | None = None
) -> torch.Tensor:
    """``F.linear`` that also accepts a weight prepacked by ``prepack_for_cpu`` (a panel-packed one
    needs ``out_features``: its last panel is zero-padded)."""
    if weight.dim() == 3:
        return _panel_gemm()(x, weight, out_features, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@lru_cache(maxsize=1)
def _panel_gemm() -> Callable[..., torch.Tensor]:
    """The kernel for panel-packed weights, chosen once (~120 calls a decode step): the native one,
    or its torch reference should the native one be turned off after the weights were packed."""
    native = native_gemm()
    if native is not None:
        return native
    from llmctl_kernels.fp32_linear import fp32_linear_torch

    return fp32_linear_torch


class UnquantizedLinearMethod:
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed = prepack_for_cpu(layer.weight.data)
        if packed is not None:  # replaces the plain weight: no second copy in memory
            layer.weight = nn.Parameter(packed, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias, layer.out_features)


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


class LoRADelta(Protocol):
    """Adds the batch's LoRA deltas to a projection's output (llmctl/lora/slots.py)."""

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...


class LinearBase(nn.Module):
    """``tp_dim`` is the weight dimension split across ranks (0 = output, 1 = input, None = replicated).
    ``lora``: set by the LoRA manager; the base projection's output gets its delta here."""

    tp_dim: int | None = None
    lora: LoRADelta | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TensorParallel,
        method: LinearMethod | None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, in_features, out_features, dtype)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def shard_of(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor along the sharded dimension."""
        dim = self.tp_dim
        if dim is None or self.tp.size == 1 or dim >= loaded.dim():  # replicated, or a row-parallel bias
            return loaded
        size = param.shape[dim]
        return loaded.narrow(dim, self.tp.rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        copy_checked(param.data, self.shard_of(param, loaded), "weight")

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora(x, out)


class ColumnParallelLinear(LinearBase):
    tp_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        dtype: torch.dtype,
        tp: TensorParallel = TensorParallel(),
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__(in_features, tp.shard(out_features, "output features"), bias, dtype, tp, method)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one matrix (e.g. gate and up of an MLP).

    Each rank holds its slice of every part, so the checkpoint's part ``i`` lands at
    ``sum(part_sizes[:i]) / tp`` in the rank-local output."""

    def __init__(
        self,
        in_features: int,
        part_sizes: list[int],
        *,
        bias: bool = False,
        dtype: torch.dtype,
        tp: TensorParallel = TensorParallel(),
        method: LinearMethod | None = None,
    ) -> None:
        self.part_sizes = [tp.shard(s, "output features") for s in part_sizes]
        LinearBase.__init__(self, in_features, sum(self.part_sizes), bias, dtype, tp, method)

    def part_offset(self, shard_id: int) -> tuple[int, int]:
        return sum(self.part_sizes[:shard_id]), self.part_sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if shard_id is None:  # a checkpoint that already stores the merged matrix
            raise ValueError("merged projection expects its parts separately")
        offset, size = self.part_offset(shard_id)
        dst = param.data.narrow(0, offset, size)
        src = loaded.narrow(0, self.tp.rank * size, size) if self.tp.size > 1 else loaded
        copy_checked(dst, src, f"part {shard_id}")


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matrix; KV heads are replicated when there are fewer than ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool = False,
        dtype: torch.dtype,
        tp: TensorParallel = TensorParallel(),
        method: LinearMethod | None = None,
    ) -> None:
        self.num_heads = tp.shard(num_heads, "attention heads")
        if num_kv_heads % tp.size and tp.size % num_kv_heads:
            raise ValueError(
                f"{num_kv_heads} KV heads cannot be split over tensor-parallel size {tp.size} "
                "(one must divide the other)"
            )
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.head_dim = head_dim
        q_out, kv_out = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.part_sizes = [q_out, kv_out, kv_out]
        LinearBase.__init__(self, hidden_size, q_out + 2 * kv_out, bias, dtype, tp, method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        index = {"q": 0, "k": 1, "v": 2}[shard_id]
        offset, size = self.part_offset(index)
        rank_slot = self.tp.rank if index == 0 else self.tp.rank // self.kv_replicas
        src = loaded.narrow(0, rank_slot * size, size) if self.tp.size > 1 else loaded
        copy_checked(param.data.narrow(0, offset, size), src, f"{shard_id}_proj")


class RowParallelLinear(LinearBase):
    tp_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        dtype: torch.dtype,
        tp: TensorParallel = TensorParallel(),
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__(tp.shard(in_features, "input features"), out_features, bias, dtype, tp, method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the partial sums are reduced.
        out = self.method.apply(self, x, None)
        if self.lora is not None:
            out = self.lora(x, out)
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias
