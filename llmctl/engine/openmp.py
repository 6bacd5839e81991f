"""Hand the CPU's OpenMP workers over to the thread that will run the engine loop.

torch (and every native kernel here, through ``at::parallel_for``) computes on an OpenMP pool, and
each host thread that starts a parallel region owns a pool of its own. A server or benchmark loads
the model in the main thread, then steps the engine in a background thread, so two pools exist;
libgomp then counts more threads than CPUs and cuts the time its idle workers spin from ~3 ms to
100 spins, so the engine thread's workers fall asleep between two kernels and are woken late for
the next. Measured on a 2-core Zen 3 with SmolLM2-135M, 64 × 128 → 128 (benchmarks/features/engine_thread.py):
the loop in the main thread ran at 180-197 output tok/s, the same loop in a second thread at
122-169, with the same CPU time.

Releasing the calling thread's pool (OpenMP 5.0 ``omp_pause_resource_all``) before the engine
thread starts leaves one pool, the engine thread's. A later parallel region in the releasing thread
recreates its pool; nothing in the server or benchmark computes there.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # free the threads, keep what can be kept (the OpenMP 5.0 enum's value)
_TORCH_LIBRARY = "libtorch_cpu.so"


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _mapped_path(file_name: str) -> Path | None:
    """The path of a shared library this process has mapped whose file name is ``file_name``."""
    maps = Path("/proc/self/maps")
    if not maps.exists():  # not Linux: libraries cannot be located this way
        return None
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
        if len(fields) == 6 and Path(fields[5]).name == file_name:
            return Path(fields[5])
    return None


@functools.cache
def _torch_openmp_symbol(name: str) -> ctypes._CFuncPtr | None:
    """``name`` as torch's own CPU library resolves it. A process can hold several OpenMP runtimes
    (scikit-learn vendors a libgomp of its own; lm-eval and others import it): looked up through
    libtorch_cpu's handle, the dynamic linker searches that library's dependencies, so the symbol
    is the one of the runtime whose pools torch's kernels use, not the first one mapped."""
    torch_cpu = _mapped_path(_TORCH_LIBRARY)
    if torch_cpu is None:
        return None
    try:
        return getattr(ctypes.CDLL(str(torch_cpu)), name)
    except (OSError, AttributeError):  # an OpenMP older than 5.0, or torch built without OpenMP
        return None


def loaded_openmp_runtime() -> Path | None:
    """The OpenMP runtime torch computes on (its own ``libgomp`` on Linux), or None."""
    function = _torch_openmp_symbol("omp_get_max_threads")
    if function is None:
        return None
    info = _DlInfo()
    if ctypes.CDLL(None).dladdr(ctypes.cast(function, ctypes.c_void_p), ctypes.byref(info)) == 0:
        return None
    return Path(info.dli_fname.decode())


def _pause_function() -> ctypes._CFuncPtr | None:
    pause = _torch_openmp_symbol("omp_pause_resource_all")
    if pause is not None:
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads. True when the runtime did so."""
    pause = _pause_function()
    if pause is None:
        return False
    rc = pause(OMP_PAUSE_SOFT)
    if rc != 0:
        log.debug("omp_pause_resource_all returned %d", rc)
    return rc == 0
