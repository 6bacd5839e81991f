"""Builds the native CPU kernels (kernels/cpu/) into ``llmctl_kernels._C`` at install time.

Everything else about the package is in pyproject.toml. The kernels are optional: where they cannot
be built (not x86-64 Linux, no C++ compiler, no torch in the build environment, a compiler error)
the install still succeeds, says why, and the engine runs its pure-torch references
(``llmctl_kernels.native_module.unavailable_reason`` says so at start).

torch's headers are needed to compile them, so install with ``--no-build-isolation`` after torch
(scripts/setup.sh does). Each translation unit compiles once, in parallel (ninja; ``MAX_JOBS``
caps the jobs). No ``-march``: the per-ISA variants are chosen at run time (kernels/cpu/isa.h).
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import setup

CPU_SOURCES = [
    "cpu_kernels.cpp",
    "quant_kernels.cpp",
    "kv_quant_attention.cpp",
    "gemm_kernels.cpp",
    "decode_loop.cpp",
    "moe_experts.cpp",
    "lora_kernels.cpp",
    "bindings.cpp",
]
# fp-contract and the AVX2 baseline differ per source: each sets its own with a pragma.
# -g0: no debug info (Python's own CFLAGS may ask for it; it doubles the build time).
CXX_FLAGS = [
    "-O3",
    "-g0",
    "-std=c++20",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-Wno-maybe-uninitialized",
    "-Wno-uninitialized",
]  # false alarms inside GCC's intrinsic headers
# -fopenmp: at::parallel_for is inline OpenMP; libgomp.so.1 resolves to the copy torch loaded.
LINK_FLAGS = ["-fopenmp"]


def _say(message: str) -> None:
    print(f"llmctl: {message}", file=sys.stderr, flush=True)


def _why_not_native() -> str | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the native kernels are built for x86-64 Linux only (this is {platform.system()} {platform.machine()})"
    if not any(shutil.which(c) for c in (os.environ.get("CXX") or "c++", "g++")):
        return "no C++ compiler found (install g++, or set CXX)"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not importable at build time (install torch first, then pip install --no-build-isolation)"
    return None


def _native_build() -> dict:
    reason = _why_not_native()
    if reason is not None:
        _say(f"building without the native CPU kernels: {reason}; the engine runs its pure-torch references")
        return {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    class OptionalBuildExtension(BuildExtension):
        """A failed kernel build is reported, not fatal: the package works without the kernels."""

        def build_extension(self, ext) -> None:
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - compiler, linker or ninja errors alike
                _say(f"the native CPU kernels failed to build ({exc}); the engine runs its pure-torch references")
                # Not an output any more: the install (editable or wheel) then copies nothing for it.
                self.extensions = [other for other in self.extensions if other is not ext]

    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    root = Path(__file__).parent
    extension = CppExtension(
        "llmctl_kernels._C",
        [str((root / "kernels" / "cpu" / name).relative_to(root)) for name in CPU_SOURCES],
        extra_compile_args=CXX_FLAGS,
        extra_link_args=LINK_FLAGS,
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": OptionalBuildExtension.with_options(use_ninja=True)}}


setup(**_native_build())
