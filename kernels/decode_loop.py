"""The native decode loop (kernels/cpu/decode_loop.cpp): every decoder layer of a decode step in
one C++ call, built once by the shared builder (``kernels/native_build.py``).

It compiles the sources of the other native modules into itself (cpu_kernels.cpp,
quant_kernels.cpp, kv_quant_attention.cpp) and so needs what they need: x86-64 with AVX2+FMA+F16C
and a C++ compiler.
Its flags are the quantized module's (the packed tiles then round exactly as there); the other
kernels keep -ffp-contract=off through a pragma in the source. ``LLMCTL_DECODE_LOOP=0`` turns it
off (the Python module path runs every step), as does ``LLMCTL_NATIVE_CPU_KERNELS=0``.
"""

from __future__ import annotations

from pathlib import Path

from llmctl_kernels import quant_native
from llmctl_kernels.native_build import LazyExtension, disabled_by

NAME = "llmctl_decode_loop"
SOURCE = Path(__file__).parent / "cpu" / "decode_loop.cpp"
HEADERS = [Path(__file__).parent / "cpu" / name
           for name in ("cpu_kernels.cpp", "cpu_kernels_isa.h", "attention_f32.h", "attention_tiles.h",
                        "prefetch_cursor.h", "fast_exp.h", "quant_kernels.cpp", "int8_gemm.h", "gemm_kernels.h",
                        "gemm_kernels_isa.h", "kv_quant_attention.cpp", "kv_quant_attention_isa.h")]
EXTENSION = LazyExtension(NAME, [SOURCE], quant_native.CFLAGS, quant_native.LDFLAGS, headers=HEADERS,
                          precondition=lambda: disabled_by("LLMCTL_DECODE_LOOP") or quant_native.native_unavailable_reason())
unavailable_reason = EXTENSION.unavailable_reason
load_decode_loop = EXTENSION.load  # the module, or None when it cannot be had here
