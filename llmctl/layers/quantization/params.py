"""A packed weight stored on a module as parameters (so ``.to(device)``, ``named_parameters`` and
``weight_bytes`` see it), and read back as the ``formats.py`` dataclass for the kernels."""

from __future__ import annotations

import torch
from torch import nn

from llmctl.layers.quantization.formats import PackedFp8, PackedInt4, PackedInt8, PackedWeight, packed_tensors

FORMAT_NAMES = {PackedInt4: "int4", PackedInt8: "int8", PackedFp8: "fp8"}


def validate_packed(packed: PackedWeight, what: str = "packed weight") -> None:
    """Raises ``ValueError`` naming the field when a packed weight breaks the ``formats.py`` contract."""
    qdtype = {PackedInt4: torch.uint8, PackedInt8: torch.int8, PackedFp8: torch.uint8}.get(type(packed))
    if qdtype is None:
        raise ValueError(f"{what}: not a packed weight ({type(packed).__name__})")
    if packed.qweight.dtype != qdtype or packed.qweight.dim() != 2:
        raise ValueError(f"{what}: qweight must be 2-D {qdtype}, got {packed.qweight.dtype} {tuple(packed.qweight.shape)}")
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


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds (packed, plain or prepacked), each storage counted once
    (tied embeddings and a packed table shared by the embedding and the LM head count once)."""
    seen: set[object] = set()
    total = 0
    for module in model.modules():
        for tensor in module._parameters.values():
            if tensor is None:
                continue
            nbytes = tensor.numel() * tensor.element_size()
            key = id(tensor) if tensor.is_mkldnn else (tensor.device, tensor.data_ptr(), nbytes)
            if key in seen:
                continue
            seen.add(key)
            total += nbytes
        extra = getattr(module, "packed_weight", None)  # a prepacked copy kept beside the plain weight
        if isinstance(extra, torch.Tensor) and id(extra) not in seen:
            seen.add(id(extra))
            total += extra.numel() * extra.element_size()
    return total
