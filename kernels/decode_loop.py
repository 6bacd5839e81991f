"""The native decode loop (kernels/cpu/decode_loop.cpp): every decoder layer of a decode step in
one C++ call, compiled at install time into ``llmctl_kernels._C.decode_loop``.

It calls the other native kernels (cpu_kernels.cpp, quant_kernels.cpp, kv_quant_attention.cpp,
gemm_kernels.cpp) linked into the same extension, and so needs what the quantized kernels need:
x86-64 with AVX2+FMA+F16C. Whether to run it at all is llmctl's choice (the Python module path
runs every step otherwise).
"""

from __future__ import annotations

from llmctl_kernels import quant_native
from llmctl_kernels.native_module import NativeKernels

# Loading the quantized kernels applies their ISA cap, which the loop's packed tiles share.
EXTENSION = NativeKernels(
    "decode_loop",
    precondition=quant_native.cpu_unsupported_reason,
    on_load=lambda module: quant_native.load_quant_native(),
)
unavailable_reason = EXTENSION.unavailable_reason
load_decode_loop = EXTENSION.load  # the module, or None when it cannot be had here
