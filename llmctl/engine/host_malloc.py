"""Keep the C heap's large blocks between engine steps on a CPU.

A batched step allocates activations of tens of MB (a 2,048-token prefill chunk of the 246M Llama:
2,048 x 5,632 bf16 gate-up outputs, 23 MB, sixteen times a step; torch's CPU allocator takes them
from malloc). glibc serves blocks above its mmap threshold with a fresh ``mmap`` and gives them
back with ``munmap``, and trims the heap top once 2x that threshold is free, so every step pays
the page faults and the kernel's zeroing of the same pages again. Measured on a 2-core AMX Xeon,
bf16 peer workload (docs/benchmarks.md, "Host memory and threads"): the four prefill chunks took
2.25-2.60 s with glibc's defaults and 2.07-2.32 s with the thresholds set here.

Set once per process through ``mallopt``: blocks up to 32 MB (glibc's largest mmap threshold on
64-bit) come from the heap, and up to 1 GiB of free heap top is kept. The cost is a resident set
that stays at its peak, as with the tcmalloc that vLLM's CPU docs preload. Where another allocator
is preloaded (tcmalloc, jemalloc) or the C library is not glibc, nothing is changed.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30
TOP_PAD_BYTES = 64 << 20


@functools.cache
def keep_large_allocations() -> bool:
    """Apply the thresholds (once). True when glibc took them."""
    try:
        libc = ctypes.CDLL(None)
        mallopt, version = libc.mallopt, libc.gnu_get_libc_version
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    version.restype = ctypes.c_char_p
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
            (M_TOP_PAD, TOP_PAD_BYTES),
        )
    )
    log.debug("glibc %s malloc thresholds %s", version().decode(), "set" if ok else "refused")
    return ok
