"""Which kernels run: the one place that decides it, from the device, the CPU's instruction set, the
engine's settings and the switches of llmctl/envs.py.

``select_kernels`` builds a ``KernelSet`` once per engine: the fused-op backend (torch or Triton),
whether the native C++ CPU kernels take over, the CPU kernel variant, and what the quantized
linear layers and the decode loop may use; ``KernelSet.description`` is the start-up line's
account of it. The kernel modules (``llmctl_kernels``) read no settings: every switch is applied
here, and every place that loads a native kernel module asks the loader functions below, so that
``LLMCTL_NATIVE_CPU_KERNELS=0`` and ``LLMCTL_CPU_ISA`` mean the same to all of them.

This module imports no model code (the layers import it): ``llmctl.layers.backends.build_ops``
turns a ``KernelSet`` into the ops object the models call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from llmctl import envs
from llmctl.errors import ConfigError

KERNEL_BACKENDS = ("auto", "torch", "triton")
# CPU kernel variants (llmctl_kernels.cpu_features ISA levels) that have the SIMD paths below.
SIMD_ISAS = frozenset({"avx2", "avx512", "avx512bf16"})
# fp32 linear layers take the native panel GEMM (kernels/cpu/gemm_kernels.cpp) by default on these:
# on a 2-core Zen 3 (AVX2+FMA) it was faster than torch's (MKL / oneDNN) at every linear shape of the
# 246M Llama and SmolLM2-135M at 1-64 rows and on par at 512; on a Zen 5 (AVX-512) on par with
# oneDNN's prepacked weight and 3-5x torch's F.linear (docs/benchmarks.md). LLMCTL_NATIVE_GEMM
# overrides it either way.
NATIVE_GEMM_ISAS = SIMD_ISAS
# The native decode loop has AVX2 and AVX-512 builds only (kernels/cpu/decode_loop.cpp).
DECODE_LOOP_ISAS = SIMD_ISAS


# ---- the CPU's instruction set -----------------------------------------------------------------


def apply_isa_cap() -> str | None:
    """Hands ``LLMCTL_CPU_ISA`` to the kernels (``llmctl_kernels.cpu_features.set_isa_cap``), which
    then act as that smaller CPU: their variants, and the bf16 units the dtype choice sees. Called
    when this module is imported and again by ``select_kernels``, so a changed variable (a test,
    an A/B run) applies to the next engine. Returns the cap."""
    from llmctl_kernels.cpu_features import set_isa_cap

    cap = envs.LLMCTL_CPU_ISA
    set_isa_cap(cap)
    return cap


def cpu_isa() -> str:
    """The CPU kernel variant that runs here (the CPU's best, lowered by ``LLMCTL_CPU_ISA``)."""
    from llmctl_kernels.cpu_features import isa_level

    return isa_level()


# ---- native CPU kernel modules: loaded only where the switches allow --------------------------


def native_cpu_off() -> str | None:
    """Why no native CPU kernel runs (None: they may, where they build and the CPU takes them)."""
    return None if envs.LLMCTL_NATIVE_CPU_KERNELS else "disabled by LLMCTL_NATIVE_CPU_KERNELS=0"


def fused_cpu_kernels() -> ModuleType | None:
    """The fused CPU ops (norms, rotary, SiLU, KV store, attention: kernels/cpu_native.py), or None."""
    if native_cpu_off():
        return None
    from llmctl_kernels.cpu_native import load_native

    return load_native()


def fused_cpu_kernels_why_not() -> str | None:
    from llmctl_kernels.cpu_native import native_unavailable_reason

    return native_cpu_off() or (None if fused_cpu_kernels() is not None else native_unavailable_reason())


def quant_cpu_kernels() -> ModuleType | None:
    """The quantized linear kernels (kernels/quant_native.py), or None."""
    if native_cpu_off():
        return None
    from llmctl_kernels.quant_native import load_quant_native

    return load_quant_native()


def quant_native_takes(packed: Any) -> bool:
    """Whether the native quantized linear kernels run this packed weight here."""
    from llmctl_kernels.quant_native import supports

    return supports(packed) and quant_cpu_kernels() is not None


def bind_quant_kernel(packed: Any, *, exact_activations: bool = False) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``x -> x @ dequantize(packed)^T`` on the native kernels with the path chosen once (the integer
    path, or exact activations; the tile-interleaved layout unless ``LLMCTL_QUANT_INTERLEAVE=0``, its
    scales stepped where they factor unless ``LLMCTL_QUANT_STEPPED_SCALES=0``), or None where only
    the torch reference applies."""
    if quant_cpu_kernels() is None:
        return None
    from llmctl_kernels.quant_native import bind_native

    return bind_native(
        packed,
        exact_activations=exact_activations,
        interleave=envs.LLMCTL_QUANT_INTERLEAVE,
        stepped=envs.LLMCTL_QUANT_STEPPED_SCALES,
    )


def kv_quant_cpu_kernels() -> ModuleType | None:
    """The quantized-KV attention and KIVI store kernels (kernels/kv_quant_native.py), or None."""
    if native_cpu_off():
        return None
    from llmctl_kernels.kv_quant_native import load_kv_quant_native

    return load_kv_quant_native()


def kv_codes_native(head_dim: int) -> bool:
    """Whether the fused kernels' 8-bit KV paths (tiled decode, quantize-on-store) take this head_dim."""
    if fused_cpu_kernels() is None:
        return False
    from llmctl_kernels.cpu_native import decode_codes_native_supported

    return decode_codes_native_supported(head_dim)


def native_gemm_wanted() -> bool:
    """``LLMCTL_NATIVE_GEMM``: 1 = on, 0 = off, auto = on where ``NATIVE_GEMM_ISAS`` has this CPU."""
    setting = envs.LLMCTL_NATIVE_GEMM
    if native_cpu_off() or setting == "0":
        return False
    return setting == "1" or cpu_isa() in NATIVE_GEMM_ISAS


def native_gemm() -> Callable[..., torch.Tensor] | None:
    """The native fp32 panel GEMM's entry point, or None where it is not wanted or cannot be built."""
    if not native_gemm_wanted():
        return None
    from llmctl_kernels.gemm_native import load_gemm_native

    module = load_gemm_native()
    return None if module is None else module.linear


def decode_loop_kernels() -> tuple[ModuleType | None, str | None]:
    """The native decode loop's module, or None and why."""
    if reason := native_cpu_off():
        return None, reason
    from llmctl_kernels.decode_loop import load_decode_loop, unavailable_reason

    module = load_decode_loop()
    return module, None if module is not None else unavailable_reason()


# ---- one engine's kernels ----------------------------------------------------------------------


@dataclass(frozen=True)
class KernelSet:
    """What one engine runs on, decided once when it is built."""

    backend: str  # "torch" or "triton": the kernels of every fused op (norms, rotary, SiLU, KV store, attention)
    device: torch.device
    native_cpu: bool  # the fused native CPU kernels take over the torch ops where they apply
    native_cpu_why_not: str | None  # why not, on a CPU with the torch backend
    isa: str | None  # the CPU kernel variant (None off a CPU)
    quant_exact_activations: bool = False  # EngineConfig.quant_exact_activations
    decode_loop: bool = True  # LLMCTL_DECODE_LOOP when the set was built

    @property
    def description(self) -> str:
        """The start-up line's account: ``torch + native CPU kernels (avx2)``, or why they are off."""
        if self.native_cpu:
            return f"{self.backend} + native CPU kernels ({self.isa})"
        if self.native_cpu_why_not:
            return f"{self.backend} (native CPU kernels off: {self.native_cpu_why_not})"
        return self.backend

    def decode_loop_why_not(self) -> str | None:
        """Why decode-only steps cannot take the native decode loop on these kernels (None: the model
        and KV pool decide; ``llmctl.models.native_decode.why_not``)."""
        if not self.decode_loop:
            return "LLMCTL_DECODE_LOOP=0"
        if self.device.type != "cpu":
            return "not a CPU"
        if self.backend != "torch":
            return f"{self.backend} kernels"
        if not self.native_cpu:
            return "native CPU kernels off" + (f": {self.native_cpu_why_not}" if self.native_cpu_why_not else "")
        if self.isa not in DECODE_LOOP_ISAS:
            return f"{self.isa} kernel variant"
        if self.quant_exact_activations:
            return "--quant-exact-activations"
        return None


def select_kernels(backend: str, device: torch.device, *, quant_exact_activations: bool = False) -> KernelSet:
    """``auto`` picks Triton on CUDA and torch elsewhere; ``triton`` on a CPU runs Triton's interpreter
    (``TRITON_INTERPRET=1`` must be set before the kernels first compile). The native CPU kernels
    take over from the torch ops on a CPU where they build and the switches allow."""
    if backend not in KERNEL_BACKENDS:
        raise ConfigError(f"unknown kernel backend {backend!r}; choose one of {', '.join(KERNEL_BACKENDS)}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    on_cpu = device.type == "cpu"
    if on_cpu:
        apply_isa_cap()
    why_not = fused_cpu_kernels_why_not() if on_cpu and backend == "torch" else None
    return KernelSet(
        backend=backend,
        device=device,
        native_cpu=on_cpu and backend == "torch" and why_not is None,
        native_cpu_why_not=why_not,
        isa=cpu_isa() if on_cpu else None,
        quant_exact_activations=quant_exact_activations,
        decode_loop=envs.LLMCTL_DECODE_LOOP,
    )


try:
    apply_isa_cap()
except ConfigError:  # a bad LLMCTL_CPU_ISA: reported as one line when an engine selects its kernels
    pass
