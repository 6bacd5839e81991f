"""The ops object a model calls for every fused op, built from an engine's ``KernelSet``
(llmctl/platform.py): ``TorchOps`` (the torch references, with the native CPU kernels where the
kernel set has them) or ``TritonOps``. Here, above both, so that neither ops module imports the other's
subclass."""

from __future__ import annotations

import torch

from llmctl.layers.ops import TorchOps
from llmctl.platform import KernelSet, select_kernels


def build_ops(kernels: KernelSet) -> TorchOps:
    """The ops of this kernel set; ``ops.kernels`` is the set (the decode loop and start-up lines read it)."""
    if kernels.backend == "torch":
        return TorchOps(native_cpu=kernels.native_cpu, kernels=kernels)
    from llmctl.layers.triton_ops import TritonOps  # imported lazily: triton is heavy to import

    return TritonOps(kernels=kernels)


def select_ops(backend: str, device: torch.device) -> TorchOps:
    """``build_ops(select_kernels(backend, device))``: the ops alone, for code that builds a model
    without an engine (tests, tools)."""
    return build_ops(select_kernels(backend, device))
