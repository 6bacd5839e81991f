"""``x @ W^T`` for a packed weight: picks the kernel for the device and format.

CUDA runs the Triton kernels, a CPU the native kernels (``kernels/quant_native.py``) where they
build and take the format; everything else the torch reference (dequantize, then matmul), except
per-channel int8 on a CPU without the native kernels: its torch statement of the kernel's exact
integer arithmetic, so that results are the same with or without them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from llmctl.layers.quantization.params import kernel_packed
from llmctl.platform import bind_quant_kernel, quant_native_takes
from llmctl_kernels.packed_formats import PackedWeight


def quant_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` in ``x``'s dtype."""
    flat = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        from llmctl_kernels.quant_triton import quant_linear_triton

        out = quant_linear_triton(flat, packed)
    elif x.device.type == "cpu" and quant_native_takes(packed):
        from llmctl_kernels.quant_native import quant_linear_native

        out = quant_linear_native(flat, packed)
    else:
        from llmctl_kernels.quant_linear import (  # kernels/ imports this package: import late
            is_per_channel_int8,
            per_channel_int8_reference,
            quant_linear_torch,
        )

        if x.device.type == "cpu" and is_per_channel_int8(packed):  # the native kernel's integers, on any CPU
            out = per_channel_int8_reference(flat, packed).to(x.dtype)
        else:
            out = quant_linear_torch(flat, packed)
    out = out.view(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


def bound_cpu_kernel(
    module: nn.Module, *, release_rows: bool = False, exact_activations: bool | None = None
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The native CPU kernel bound to this module's packed weight (``x [M, K] -> [M, N]``; float16
    scales where exact, ``kernel_packed``), or None where only the torch reference applies. Bound
    once and kept on the module while it holds the same ``qweight``: decode then pays no per-call
    dispatch (format checks, imports, the settings), ~120 calls a step.

    ``release_rows`` (linear layers): once the kernel reads its own tile-interleaved copy (which
    carries the scales and mins too), the row-layout ``qweight``, ``scales`` and ``mins`` are
    replaced by meta tensors of the same shapes, so the weight is held once, not twice. Nothing on a
    CPU reads them after binding; a read of their values would fail loudly. A tied LM head keeps its
    rows: the embedding looks tokens up in them.

    ``exact_activations`` (``EngineConfig.quant_exact_activations``, given when the engine binds its
    model): int4/int8 multiply the exact activations instead of int16-rounded ones. None keeps what
    the layer was bound with (False for a layer never bound)."""
    cached = module.__dict__.get("_bound_cpu_kernel")
    exact = (cached is not None and cached[2]) if exact_activations is None else exact_activations
    if cached is None or cached[0] is not module.qweight or (cached[2] != exact and not module.qweight.is_meta):
        cached = (module.qweight, bind_quant_kernel(kernel_packed(module), exact_activations=exact), exact)
        module.__dict__["_bound_cpu_kernel"] = cached
    if release_rows and getattr(cached[1], "tiles", None) is not None and not module.qweight.is_meta:
        _release_rows(module)
        cached = (module.qweight, *cached[1:])
        module.__dict__["_bound_cpu_kernel"] = cached
    return cached[1]


def bound_exact_activations(module: nn.Module) -> bool:
    """Whether ``bound_cpu_kernel`` bound this module's kernel to the exact activations (False for
    the integer path, or for a module never bound): a caller binding the same weight elsewhere
    (the native MoE layer) takes the path this one runs."""
    cached = module.__dict__.get("_bound_cpu_kernel")
    return cached is not None and cached[2]


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def _release_rows(module: nn.Module) -> None:
    """Meta tensors in place of the row-layout parameters, and of ``kernel_packed``'s float16
    copies of the scales and mins, re-keyed to the new ``scales`` so that they are not rebuilt:
    the native decode loop, which binds the same tiles, still learns the scales' dtype from them."""
    for name in ("qweight", "scales", "mins"):
        tensor = module._parameters.get(name)
        if tensor is not None:
            module._parameters[name] = nn.Parameter(_meta_like(tensor), requires_grad=False)
    kernel_scales = module.__dict__.get("_kernel_scales")
    if kernel_scales is not None:
        copies = (None if t is None else _meta_like(t) for t in kernel_scales[1:])
        module.__dict__["_kernel_scales"] = (module.scales, *copies)
