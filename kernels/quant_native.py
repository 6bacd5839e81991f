"""Native CPU kernels for quantized linear layers (C++ in kernels/cpu/quant_kernels.cpp), built
once by the shared builder (``kernels/native_build.py``: cache key, stale-lock takeover, time limit).

A separate module from the other native kernels so that either builds alone. Optional: without a
C++ compiler, on a CPU without AVX2/FMA/F16C, or with ``LLMCTL_NATIVE_CPU_KERNELS=0``, quantized
layers use the torch reference (``kernels/quant_linear.py``).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from llmctl_kernels.cpu_features import cpu_flags
from llmctl_kernels.native_build import LazyExtension, disabled_by

NAME = "llmctl_quant"
SOURCE = Path(__file__).parent / "cpu" / "quant_kernels.cpp"
# AVX2+FMA+F16C is the baseline (checked below before building); the AVX-512 functions carry their
# own target attributes and are chosen at run time.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
LDFLAGS = ["-fopenmp"]
# Rows of x up to which the fp8 kernel converts weights inside its dot products; above, it dequantizes
# slabs of the weight for torch's GEMM (both compute the same float products).
FP8_DIRECT_MAX_ROWS = 32


def _precondition() -> str | None:
    if reason := disabled_by("LLMCTL_NATIVE_CPU_KERNELS"):
        return reason
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"quantized CPU kernels are built for x86-64 only (this is {platform.machine()})"
    missing = {"avx2", "fma", "f16c"} - cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    return None


HEADERS = [Path(__file__).parent / "cpu" / "int8_gemm.h"]  # included by the source: part of the cache key
EXTENSION = LazyExtension(NAME, [SOURCE], CFLAGS, LDFLAGS, headers=HEADERS, precondition=_precondition)
native_unavailable_reason = EXTENSION.unavailable_reason
load_quant_native = EXTENSION.load  # the module, or None (the builder says why once on stderr)
_module_or_raise = EXTENSION.require


def supports(packed) -> bool:
    """Whether the native kernels take this packed weight's shape and grouping."""
    from llmctl.layers.quantization.formats import PackedFp8, PackedInt4, PackedInt8

    n, k = packed.shape
    if isinstance(packed, PackedInt4):
        return packed.group_size % 32 == 0
    if isinstance(packed, PackedInt8):
        return k % 32 == 0 and (packed.group_size == 16 or packed.group_size % 32 == 0)
    return isinstance(packed, PackedFp8) and k % 16 == 0


def _exact_activations() -> bool:
    return os.environ.get("LLMCTL_QUANT_EXACT_ACTIVATIONS") == "1"


def quant_linear_native(x: torch.Tensor, packed, slab: bool | None = None) -> torch.Tensor:
    """``x [M, K] @ dequantize(packed)^T`` in ``x``'s dtype.

    ``slab`` False: int4/int8 multiply int16-rounded activations in integers, fp8 converts weights in
    the dot products; True: dequantize slabs of the weight and use torch's GEMM with the exact
    activations. None: fp8 by the number of rows, int4/int8 the integer path (at any M, so results
    do not depend on the batch) unless ``LLMCTL_QUANT_EXACT_ACTIVATIONS=1``."""
    from llmctl.layers.quantization.formats import PackedInt4, PackedInt8

    module = _module_or_raise()
    if isinstance(packed, (PackedInt4, PackedInt8)):
        int_path = not (_exact_activations() if slab is None else slab)
        linear = module.int4_linear if isinstance(packed, PackedInt4) else module.int8_linear
        return linear(x, packed.qweight, packed.scales, packed.mins, packed.group_size, int_path)
    direct = x.shape[0] <= FP8_DIRECT_MAX_ROWS if slab is None else not slab
    return module.fp8_linear(x, packed.qweight, packed.scales, direct)


def bind_native(packed) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``quant_linear_native(x, packed)`` with the kernel, its arguments and the path chosen once
    (``LLMCTL_QUANT_EXACT_ACTIVATIONS`` is read here), or None where the native kernels do not take
    this weight. Why: at decode sizes the per-call Python dispatch (format checks, imports, the
    environment) cost several times the kernel itself, over ~120 calls a token. The integer path of
    a grouped int4/int8 weight is bound to its tile-interleaved copy (``InterleavedKernel``)."""
    from llmctl.layers.quantization.formats import PackedInt4, PackedInt8

    if not supports(packed) or load_quant_native() is None:
        return None
    module = EXTENSION.module
    if isinstance(packed, (PackedInt4, PackedInt8)):
        int_path = not _exact_activations()
        if int_path and interleaves(packed):
            return InterleavedKernel(module, packed)
        linear = module.int4_linear if isinstance(packed, PackedInt4) else module.int8_linear
        args = (packed.qweight, packed.scales, packed.mins, packed.group_size, int_path)
        return lambda x: linear(x, *args)
    fp8_linear, qweight, scales = module.fp8_linear, packed.qweight, packed.scales
    return lambda x: fp8_linear(x, qweight, scales, x.shape[0] <= FP8_DIRECT_MAX_ROWS)


def interleaves(packed) -> bool:
    """Whether the integer path binds this weight to the tile-interleaved layout: int4, and int8 in
    groups of 32 (GGUF's Q8_0) up to K/2 (a per-output-channel int8 weight keeps ``int8_linear``);
    ``LLMCTL_QUANT_INTERLEAVE=0`` keeps the row layout (the A/B switch)."""
    from llmctl.layers.quantization.formats import PackedInt4

    k, group = packed.shape[1], packed.group_size
    fits = group % 32 == 0 and (isinstance(packed, PackedInt4) or 2 * group <= k)
    return fits and packed.qweight.device.type == "cpu" and os.environ.get("LLMCTL_QUANT_INTERLEAVE") != "0"


class InterleavedKernel:
    """The integer path of an int4/int8 weight from its tile-interleaved copy (``interleave_tiles``
    in quant_kernels.cpp: each tile of 4 rows is one run of bytes, blocks with their scales and
    mins, read as one sequential stream instead of 12). Made once when bound; the same bits as the
    row layout. ``tiles`` and its description are what the native decode loop binds too (one copy)."""

    def __init__(self, module, packed) -> None:
        from llmctl.layers.quantization.formats import PackedInt4

        self.int4 = isinstance(packed, PackedInt4)
        self.n, self.group = packed.shape[0], packed.group_size
        self.half = packed.scales.dtype == torch.float16
        self.has_mins = packed.mins is not None
        self.tiles = module.interleave_tiles(packed.qweight, packed.scales, packed.mins, self.group)
        self._linear = module.interleaved_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.tiles, self.int4, self.n, self.group, self.half, self.has_mins)


if __name__ == "__main__":  # `python -m llmctl_kernels.quant_native`: build ahead of time
    import logging
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load_quant_native()
    print(f"quantized CPU kernels: {module.__file__ + ' (' + module.isa() + ')' if module else native_unavailable_reason()}")
    sys.exit(0)
