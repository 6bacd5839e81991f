"""Native CPU kernels (C++, built on first use with torch's extension builder and cached).

Optional: where no C++ compiler is available, or ``LLMCTL_NATIVE_CPU_KERNELS=0`` is set, the
engine keeps the pure-torch references. The build is cached per CPU (it is tuned with
``-march=native``) under torch's extension cache, so only the first run on a machine pays for it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "cpu" / "cpu_kernels.cpp"
_lock = threading.Lock()
_module: ModuleType | None = None
_failed: str | None = None


def _cpu_tag() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    digest = hashlib.sha256((flags + SOURCE.read_text() + torch.__version__ + "omp").encode()).hexdigest()
    return digest[:10]


def native_unavailable_reason() -> str | None:
    if os.environ.get("LLMCTL_NATIVE_CPU_KERNELS", "1") == "0":
        return "disabled by LLMCTL_NATIVE_CPU_KERNELS=0"
    if platform.system() != "Linux":
        return f"native CPU kernels are built on Linux only (this is {platform.system()})"
    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
        return "no C++ compiler found"
    return _failed


def load_native() -> ModuleType | None:
    """The compiled module, building it on first call; None (with the reason logged once) when it
    cannot be built here."""
    global _module, _failed
    with _lock:
        if _module is not None or native_unavailable_reason() is not None:
            return _module
        from torch.utils.cpp_extension import load

        try:
            # -fopenmp: at::parallel_for is inline OpenMP; the module then needs libgomp.so.1, which
            # resolves to the copy torch already loaded (same soname), so there is one thread pool.
            _module = load(name=f"llmctl_cpu_{_cpu_tag()}", sources=[str(SOURCE)],
                           extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno",
                                         "-fno-trapping-math"], extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # a compiler error, missing headers, a linker problem...
            _failed = f"building the native CPU kernel failed: {str(exc).strip().splitlines()[-1] if str(exc) else exc!r}"
            log.warning("%s; using the pure-torch path", _failed)
        return _module


def paged_decode_attention_native(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same signature and result as ``paged_decode_attention_torch`` (up to rounding)."""
    return _module_or_raise().paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as ``rms_norm_torch``; ``x`` may have any leading shape."""
    shape = x.shape
    out, new_residual = _module_or_raise().rms_norm(
        x.reshape(-1, shape[-1]), weight, eps, None if residual is None else residual.reshape(-1, shape[-1]))
    return out.view(shape), new_residual.view(shape)


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """Same signature and result as ``silu_and_mul_torch`` (2-D input)."""
    return _module_or_raise().silu_and_mul(x)


def rotary_embedding_native(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                            cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as ``rotary_embedding_torch``."""
    module = _module_or_raise()
    return module.rotate(query, positions, cos_sin_cache), module.rotate(key, positions, cos_sin_cache)


def reshape_and_cache_native(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same signature and effect as ``reshape_and_cache_torch`` (one memcpy per token, -1 skipped)."""
    _module_or_raise().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def _module_or_raise() -> ModuleType:
    module = load_native()
    if module is None:
        raise RuntimeError(native_unavailable_reason() or "native CPU kernels unavailable")
    return module


if __name__ == "__main__":  # `python -m kernels.cpu_native`: build ahead of time (scripts/setup.sh does)
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load_native()
    print(f"native CPU kernels: {module.__file__ if module else native_unavailable_reason()}")
    sys.exit(0)
