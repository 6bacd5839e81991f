"""A packed weight stored on a module as parameters (so ``.to(device)``, ``named_parameters`` and
``weight_bytes`` see it), and read back as the ``formats.py`` dataclass for the kernels."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from llmctl import envs
from llmctl_kernels.packed_formats import (
    PackedFp8,
    PackedInt4,
    PackedInt8,
    PackedWeight,
    packed_tensors,
)

FORMAT_NAMES = {PackedInt4: "int4", PackedInt8: "int8", PackedFp8: "fp8"}


def validate_packed(packed: PackedWeight, what: str = "packed weight") -> None:
    """Raises ``ValueError`` naming the field when a packed weight breaks the ``formats.py`` contract."""
    qdtype = {PackedInt4: torch.uint8, PackedInt8: torch.int8, PackedFp8: torch.uint8}.get(type(packed))
    if qdtype is None:
        raise ValueError(f"{what}: not a packed weight ({type(packed).__name__})")
    if packed.qweight.dtype != qdtype or packed.qweight.dim() != 2:
        raise ValueError(
            f"{what}: qweight must be 2-D {qdtype}, got {packed.qweight.dtype} {tuple(packed.qweight.shape)}"
        )
    n, k = packed.shape
    groups = 1 if isinstance(packed, PackedFp8) else k // packed.group_size
    if not isinstance(packed, PackedFp8) and (packed.group_size < 1 or k % packed.group_size):
        raise ValueError(f"{what}: group_size {packed.group_size} does not divide {k} input features")
    if isinstance(packed, PackedInt4) and packed.group_size % 2:
        raise ValueError(f"{what}: int4 group_size must be even, got {packed.group_size}")
    expected = (n,) if isinstance(packed, PackedFp8) else (n, groups)
    for name, tensor in packed_tensors(packed).items():
        if name == "qweight":
            continue
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != expected:
            raise ValueError(f"{what}: {name} must be float32 {expected}, got {tensor.dtype} {tuple(tensor.shape)}")


def attach_packed(module: nn.Module, packed: PackedWeight, device: torch.device) -> None:
    """Replaces ``module.weight`` (freed) by the packed tensors, as frozen parameters."""
    validate_packed(packed, type(module).__name__)
    if "weight" in module._parameters:
        del module._parameters["weight"]
    for name in ("qweight", "scales", "mins"):
        module._parameters.pop(name, None)
    for name, tensor in packed_tensors(packed).items():
        module.register_parameter(name, nn.Parameter(tensor.to(device).contiguous(), requires_grad=False))
    module.packed_format = FORMAT_NAMES[type(packed)]
    module.packed_group_size = getattr(packed, "group_size", packed.shape[1])


def read_packed(module: nn.Module) -> PackedWeight:
    """The packed weight a module holds (views of its parameters, no copy)."""
    kind, group = module.packed_format, module.packed_group_size
    if kind == "int4":
        return PackedInt4(module.qweight, module.scales, module.mins, group)
    if kind == "int8":
        return PackedInt8(module.qweight, module.scales, module._parameters.get("mins"), group)
    return PackedFp8(module.qweight, module.scales)


def kernel_packed(module: nn.Module) -> PackedWeight:
    """What the native CPU kernels read: ``read_packed(module)``, with float16 copies of an int4 or
    int8 weight's scales and mins where every value is exactly a float16 (a GGUF file's are: its
    blocks store float16). Why: decode streams every weight byte once a step and is bound by memory
    bandwidth on small CPUs; Q4_1 then reads 0.625 bytes a weight instead of 0.75, with the same
    results bit for bit. Kept on the module (``weight_bytes`` counts it): the layer's bound kernel
    and the native decode loop share one copy."""
    packed = read_packed(module)
    if (
        not isinstance(packed, (PackedInt4, PackedInt8))
        or packed.scales.device.type not in ("cpu", "meta")
        or not envs.LLMCTL_QUANT_HALF_SCALES
    ):  # the A/B switch: float32 scales
        return packed
    cached = module.__dict__.get("_kernel_scales")
    if cached is None or cached[0] is not packed.scales:
        cached = (packed.scales, *_exact_half(packed.scales, packed.mins))
        module.__dict__["_kernel_scales"] = cached
    return dataclasses.replace(packed, scales=cached[1], mins=cached[2])


def _exact_half(scales: torch.Tensor, mins: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float16 copies of both, or both unchanged unless every value survives the round trip."""
    halves = (scales.half(), None if mins is None else mins.half())
    exact = all(t is None or torch.equal(h.float(), t) for t, h in zip((scales, mins), halves))
    return halves if exact else (scales, mins)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds (packed, plain or prepacked), each storage counted once
    (tied embeddings and a packed table shared by the embedding and the LM head count once)."""
    seen: set[object] = set()
    total = 0
    for module in model.modules():
        tensors = [t for t in module._parameters.values() if t is not None]
        tensors.append(getattr(module, "packed_weight", None))  # a prepacked copy kept beside the plain weight
        logits_packed = getattr(module, "logits_packed", None)  # an LM head's int8 copy (ParallelLMHead)
        tensors += [logits_packed.qweight, logits_packed.scales] if logits_packed is not None else []
        tensors += module.__dict__.get("_kernel_scales", ())[1:]  # float16 scales for the kernels (kernel_packed)
        bound = module.__dict__.get("_bound_cpu_kernel")  # matmul.bound_cpu_kernel: its interleaved copy, if any
        tensors.append(getattr(bound[1], "tiles", None) if bound else None)
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:  # meta: released (bound_cpu_kernel)
                continue
            nbytes = tensor.numel() * tensor.element_size()
            key = id(tensor) if tensor.is_mkldnn else (tensor.device, tensor.data_ptr(), nbytes)
            if key not in seen:
                seen.add(key)
                total += nbytes
    return total
