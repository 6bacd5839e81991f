"""What every benchmark records the same way: the CPU it ran on, a best-of timing, a JSON result.

A figure means little without the machine behind it, so results carry the CPU model and the ISA flags that
decide which kernels run, both read by ``llmctl_kernels.cpu_features`` (the answer the engine itself acts on).
Some scripts also run in a peer engine's interpreter (llama-cpp-python, transformers) that has no llmctl
installed: there the checkout's own ``kernels/cpu_features.py`` is loaded from its file (it needs only the
standard library).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

# The flags that choose a kernel variant or a dtype (kernels/cpu_features.py, ISA_LEVELS and bf16 units).
ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def _cpu_features() -> ModuleType:
    try:
        from llmctl_kernels import cpu_features
    except ImportError:  # a peer's interpreter: the checkout's file, which imports only the standard library
        path = Path(__file__).resolve().parents[1] / "kernels" / "cpu_features.py"
        spec = importlib.util.spec_from_file_location("llmctl_cpu_features", path)
        cpu_features = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cpu_features)
    return cpu_features


def cpu_record() -> dict[str, str]:
    """The CPU model and its kernel-relevant ISA flags, as the ``cpu`` and ``isa`` fields of a result."""
    features = _cpu_features()
    flags = features.cpu_flags()
    return {"cpu": features.cpu_model(), "isa": " ".join(f for f in ISA_FLAGS if f in flags)}


def cpu_line() -> str:
    """``cpu_record`` as one line for a report's header: model, CPU count and flags."""
    record = cpu_record()
    return f"{record['cpu']} ({os.cpu_count()} CPUs; {record['isa'] or 'no listed ISA flags'})"


def best_of(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """The least wall time of ``reps`` calls of ``fn`` after ``warmup`` untimed ones (caches, thread pools):
    on a shared machine the least disturbed call is the one that measures the work."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def write_result(
    result: dict, path: Path | str | None, hidden: Iterable[str] = ("out_ids",), indent: int | None = None
) -> None:
    """Write the whole result as JSON to ``path`` (if given) and print it as one ``RESULT {...}`` line without
    the bulky ``hidden`` fields (token ids, texts): the shell scripts grep that line."""
    if path is not None:
        Path(path).write_text(json.dumps(result, indent=indent) + "\n")
    hidden = set(hidden)
    print("RESULT", json.dumps({k: v for k, v in result.items() if k not in hidden}))
