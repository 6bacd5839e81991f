"""Native CPU kernels for quantized linear layers (C++ in kernels/cpu/quant_kernels.cpp), compiled
at install time into ``llmctl_kernels._C.quant``.

Optional: where they were not built, or on a CPU without AVX2/FMA/F16C, quantized layers use the
torch reference (``kernels/quant_linear.py``); whether to use them at all is llmctl's choice.
"""

from __future__ import annotations

import platform
from collections.abc import Callable

import torch

from llmctl_kernels.cpu_features import cpu_flags, isa_level, on_isa_cap_change
from llmctl_kernels.native_module import NativeKernels
from llmctl_kernels.packed_formats import PackedFp8, PackedInt4, PackedInt8

# Rows of x up to which the fp8 kernel converts weights inside its dot products; above, it dequantizes
# slabs of the weight for torch's GEMM (both compute the same float products).
FP8_DIRECT_MAX_ROWS = 32
# Inputs per step of the stepped scale format (quant_kernels.h's STEP: GGUF's K-quant super-block)
STEP_INPUTS = 256
# What the blocks of interleaved tiles hold (quant_kernels.h): int8 values, int4 nibbles, or int8
# values that are all MXFP4's (doubled) kept as 4-bit codes
INT8_TILES, INT4_TILES, E2M1_TILES = 0, 1, 2


def cpu_unsupported_reason() -> str | None:
    """Why this CPU cannot run the quantized kernels (their AVX2+FMA+F16C baseline); None when it can."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"quantized CPU kernels are built for x86-64 only (this is {platform.machine()})"
    missing = {"avx2", "fma", "f16c"} - cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    return None


def _select_variant(module) -> None:
    """The AVX-512 tiles run where the CPU has them unless ``set_isa_cap`` lowers the level (avx2: the
    AVX2 tiles; generic: per-channel int8's scalar tile too)."""
    module.set_isa(isa_level())
    on_isa_cap_change(lambda: module.set_isa(isa_level()))


EXTENSION = NativeKernels("quant", precondition=cpu_unsupported_reason, on_load=_select_variant)
native_unavailable_reason = EXTENSION.unavailable_reason
load_quant_native = EXTENSION.load  # the module, or None (why: said once on stderr)
_module_or_raise = EXTENSION.require


def supports(packed) -> bool:
    """Whether the native kernels take this packed weight's shape and grouping."""
    n, k = packed.shape
    if isinstance(packed, PackedInt4):
        return packed.group_size % 32 == 0
    if isinstance(packed, PackedInt8):
        return k % 32 == 0 and (packed.group_size == 16 or packed.group_size % 32 == 0)
    return isinstance(packed, PackedFp8) and k % 16 == 0


def quant_linear_native(
    x: torch.Tensor, packed, slab: bool | None = None, *, exact_activations: bool = False
) -> torch.Tensor:
    """``x [M, K] @ dequantize(packed)^T`` in ``x``'s dtype.

    ``slab`` False: int4/int8 multiply int16-rounded activations in integers, fp8 converts weights in
    the dot products; True: dequantize slabs of the weight and use torch's GEMM with the exact
    activations. None: fp8 by the number of rows, int4/int8 the integer path (at any M, so results
    do not depend on the batch) unless ``exact_activations``."""
    module = _module_or_raise()
    if isinstance(packed, (PackedInt4, PackedInt8)):
        int_path = not (exact_activations if slab is None else slab)
        linear = module.int4_linear if isinstance(packed, PackedInt4) else module.int8_linear
        return linear(x, packed.qweight, packed.scales, packed.mins, packed.group_size, int_path)
    direct = x.shape[0] <= FP8_DIRECT_MAX_ROWS if slab is None else not slab
    return module.fp8_linear(x, packed.qweight, packed.scales, direct)


def bind_native(
    packed, *, exact_activations: bool = False, interleave: bool = True, stepped: bool = True
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``quant_linear_native(x, packed, exact_activations=...)`` with the kernel, its arguments and
    the path chosen once, or None where the native kernels do not take this weight. Why: at decode
    sizes the per-call Python dispatch (format checks, imports) cost several times the kernel
    itself, over ~120 calls a token. The integer path of a grouped int4/int8 weight is bound to its
    tile-interleaved copy (``InterleavedKernel``) unless ``interleave`` is False (the A/B switch);
    ``stepped=False`` keeps its scales out of the stepped format there (the A/B switch)."""
    if not supports(packed) or load_quant_native() is None:
        return None
    module = EXTENSION.module
    if isinstance(packed, (PackedInt4, PackedInt8)):
        int_path = not exact_activations
        if int_path and interleaves(packed, interleave=interleave):
            return InterleavedKernel(module, packed, stepped=stepped)
        linear = module.int4_linear if isinstance(packed, PackedInt4) else module.int8_linear
        args = (packed.qweight, packed.scales, packed.mins, packed.group_size, int_path)
        return lambda x: linear(x, *args)
    fp8_linear, qweight, scales = module.fp8_linear, packed.qweight, packed.scales
    return lambda x: fp8_linear(x, qweight, scales, x.shape[0] <= FP8_DIRECT_MAX_ROWS)


def interleaves(packed, *, interleave: bool = True) -> bool:
    """Whether the integer path binds this weight to the tile-interleaved layout: int4, and int8 in
    groups of 32 (GGUF's Q8_0) up to K/2 (a per-output-channel int8 weight keeps ``int8_linear``)
    or of 16 (Q6_K); ``interleave=False`` keeps the row layout (the A/B switch)."""
    k, group = packed.shape[1], packed.group_size
    int4 = isinstance(packed, PackedInt4)
    fits = (group % 32 == 0 and (int4 or 2 * group <= k)) or (not int4 and group == 16 and k % 32 == 0)
    return interleave and fits and packed.qweight.device.type == "cpu"


class InterleavedKernel:
    """The integer path of an int4/int8 weight from its tile-interleaved copy (``interleave_tiles``
    in quant_kernels.cpp: each tile of 4 rows is one run of bytes, blocks with their scales and
    mins, read as one sequential stream instead of 12). Made once when bound; below
    ``set_qgemm_min_rows`` rows of x (8; 3 for int4 weights on a CPU without AVX512-VNNI) the
    same bits as the row layout, from there on the many-row GEMM of kernels/cpu/qgemm.h, which
    reads the same tiles (prefill, batched decode, the MoE experts' rows).
    ``tiles`` and its description are what the native decode loop binds too (one copy).

    Scales and mins that factor as an int8 per group times a float32 step per 256 inputs (GGUF's
    K-quants: ``d * sc`` per super-block) are stored so (``scale_bytes`` 1, "stepped"): Q4_K then
    reads 4.75 bits a weight instead of 6 (float32 scales), Q6_K 8.6 instead of 10, with the same
    bits out (the kernels multiply back the very float32 values). Otherwise float16 where the
    caller gave exact float16 copies (``scale_bytes`` 2), else float32 (4).

    An int8 weight in groups of 32 whose every value is one of MXFP4's sixteen (doubled: MXFP4
    experts repacked as int8, llmctl/models/mxfp4.py) keeps them as 4-bit codes (``kind``
    ``E2M1_TILES``): half the bytes, the same products and bits."""

    def __init__(self, module, packed, *, stepped: bool = True) -> None:
        int4 = isinstance(packed, PackedInt4)
        self.n, self.group = packed.shape[0], packed.group_size
        self.has_mins = packed.mins is not None
        e2m1 = not int4 and self.group % 32 == 0 and module.e2m1_codes(packed.qweight)
        self.kind = INT4_TILES if int4 else E2M1_TILES if e2m1 else INT8_TILES
        steps = _stepped_scales(module, packed) if stepped else None
        if steps is not None:
            self.scale_bytes = 1
            self.tiles = module.interleave_tiles(packed.qweight, *steps[:2], self.group, *steps[2:], e2m1=e2m1)
        else:
            self.scale_bytes = packed.scales.element_size()
            self.tiles = module.interleave_tiles(packed.qweight, packed.scales, packed.mins, self.group, e2m1=e2m1)
        self._linear = module.interleaved_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.tiles, self.kind, self.n, self.group, self.scale_bytes, self.has_mins)


def _stepped_scales(module, packed) -> tuple | None:
    """``(int8 scales, int8 mins or None, scale steps, min steps or None)`` for ``interleave_tiles``,
    or None where the scales (or mins) do not factor exactly or K is not whole steps."""
    k, group = packed.shape[1], packed.group_size
    if k % STEP_INPUTS != 0 or STEP_INPUTS % group != 0 or group == STEP_INPUTS:
        return None
    scales = module.step_scales(packed.scales.float().contiguous(), group)
    if scales is None:
        return None
    if packed.mins is None:
        return scales[0], None, scales[1], None
    mins = module.step_scales(packed.mins.float().contiguous(), group)
    return None if mins is None else (scales[0], mins[0], scales[1], mins[1])


if __name__ == "__main__":  # `python -m llmctl_kernels.quant_native`: whether this install has them
    module = load_quant_native()
    print(f"quantized CPU kernels: {f'{module.__name__} ({module.isa()})' if module else native_unavailable_reason()}")
