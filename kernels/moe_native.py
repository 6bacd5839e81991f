"""One mixture-of-experts layer's packed experts in one native call (kernels/cpu/moe_experts.cpp),
compiled at install time into ``llmctl_kernels._C.moe``.

Why: from Python, a decoded token runs ~3 short parallel regions per active expert and layer
(~330 a token on a 24-layer, top-8 model), each paying a wake-up of the threads; the native call
runs every active expert's chain (gate_up, SiLU-and-mul, down) as one work item of a single
parallel region, with the kernels each projection's bound Python kernel runs, so the bits agree.
It needs what the quantized kernels need (x86-64 with AVX2+FMA+F16C); whether to use it is
llmctl's choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl_kernels import quant_native
from llmctl_kernels.native_module import NativeKernels

EXTENSION = NativeKernels(
    "moe",
    precondition=quant_native.cpu_unsupported_reason,
    on_load=lambda module: quant_native.load_quant_native(),  # applies the ISA cap the kernels share
)
load_moe_native = EXTENSION.load  # the module, or None when it cannot be had here

# how a projection's bound kernel reads its weight (moe_experts.cpp's Layout)
TILES, ROWS, PER_CHANNEL = 0, 1, 2


@dataclass(frozen=True)
class ProjectionSpec:
    """One expert projection as its bound kernel reads it: ``weight`` is the tiles
    (``InterleavedKernel.tiles``) or the packed ``qweight``; ``scales`` / ``mins`` the row
    layout's (as that kernel was given them); ``k`` the weight's input columns, ``in_features``
    the projection's (the rest are zero columns the inputs are padded to); ``scale_bytes`` the
    tiles' scale format (``InterleavedKernel.scale_bytes``; the row layouts read their scales' dtype)."""

    layout: int
    kind: int  # what the weight's blocks hold: quant_native's INT8_TILES, INT4_TILES or E2M1_TILES (tiles only)
    n: int
    k: int
    group: int
    in_features: int
    scale_bytes: int
    has_mins: bool
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None


# the activation between gate_up and down (moe_experts.cpp's Activation)
SILU_AND_MUL, CLAMPED_SWIGLU = 0, 1


@dataclass(frozen=True)
class ActivationSpec:
    """SiLU-and-mul, or gpt-oss's clamped SwiGLU with its ``alpha`` and ``limit``."""

    kind: int = SILU_AND_MUL
    alpha: float = 0.0
    limit: float = 0.0


@dataclass(frozen=True)
class ExpertSpec:
    """One expert: ``gate_up`` one merged projection (gate rows, then up) or two (gate, up);
    ``down``; optional float32 biases added after each product (``[2 * inner]``, ``[hidden]``)."""

    gate_up: list[ProjectionSpec]
    down: ProjectionSpec
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


class NativeExperts:
    """A layer's experts bound once. Calling it:
    ``(x [T, H] fp32, weights [T, k] fp32, ids [T, k]) -> [T, H]``."""

    def __init__(
        self,
        hidden: int,
        inner: int,
        experts: list[ExpertSpec],
        activation: ActivationSpec = ActivationSpec(),
        module=None,
    ) -> None:
        module = module if module is not None else EXTENSION.require()
        self._experts = module.Experts(hidden, inner, activation.kind, activation.alpha, activation.limit)
        for e in experts:
            gate_up = [_bind(module, p) for p in e.gate_up]
            self._experts.add_expert(gate_up, _bind(module, e.down), e.gate_up_bias, e.down_bias)
        self._forward = self._experts.forward

    @property
    def module(self):
        """The bound ``_C.moe.Experts`` object (the native decode loop calls it too)."""
        return self._experts

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self._forward(x, weights, ids)


def _bind(module, p: ProjectionSpec):
    return module.make_projection(
        p.layout, p.kind, p.n, p.k, p.group, p.in_features, p.scale_bytes, p.has_mins, p.weight, p.scales, p.mins
    )
