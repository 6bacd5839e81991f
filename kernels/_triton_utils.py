"""Small helpers shared by the Triton kernel wrappers (no triton import here)."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    The interpreter stores bf16 as raw uint16 and multiplies bf16 ``tl.dot`` operands wrongly, so
    the kernels upcast every operand to fp32 there; on a GPU they feed native bf16/fp16 to the
    tensor cores and accumulate in fp32.
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def next_pow2(n: int) -> int:
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs programs one
    at a time, so splitting work for occupancy buys nothing there)."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 1


def dots_in_fp32(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands are upcast to fp32 (fp32 inputs, or the interpreter)."""
    return dtype == torch.float32 or interpreting()


def fp32_dot_precision() -> str:
    """``input_precision`` of fp32 ``tl.dot``s: ``tf32x3`` on a GPU (fp32-level accuracy on the
    tensor cores; plain ``ieee`` runs on the FMA units and spills registers at attention tile
    sizes), ``ieee`` under the interpreter (which multiplies in numpy either way)."""
    return "ieee" if interpreting() else "tf32x3"


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
