"""Linear methods for packed weights, and the two ways packed weights reach a layer:

- ``install_packed_weight(layer, packed)``: a loader (GGUF) that already holds packed tensors
  swaps them into a built layer;
- ``OnTheFlyQuantMethod``: ``--quantization int8|int4|fp8`` loads the float checkpoint as usual,
  then quantizes each linear layer in ``process_weights_after_loading``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.layers.linear import LinearBase, LinearMethod, UnquantizedLinearMethod
from llmctl.layers.quantization.gptq import gptq_quantize
from llmctl.layers.quantization.matmul import bound_cpu_kernel, quant_linear
from llmctl.layers.quantization.params import attach_packed, read_packed
from llmctl.layers.quantization.quantize import quantize
from llmctl_kernels.packed_formats import PackedWeight

QUANTIZATION_KINDS = ("none", "int8", "int4", "fp8")
INT4_GROUP_SIZES = (32, 64, 128)


class PackedLinearMethod:
    """A layer whose weight is packed (``qweight``/``scales``/``mins`` parameters). On a CPU the
    native kernel is bound once per weight (``bound_cpu_kernel``) and reused while the layer holds
    the same ``qweight`` tensor."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        raise TypeError("packed weights are installed with install_packed_weight, not loaded by name")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        padding = layer.qweight.shape[1] * (2 if layer.packed_format == "int4" else 1) - x.shape[-1]
        if padding:  # zero inputs meet the zero-padded weight columns
            x = F.pad(x, (0, padding))
        kernel = bound_cpu_kernel(layer, release_rows=True) if x.device.type == "cpu" else None
        if kernel is None:
            return quant_linear(x, read_packed(layer), bias)
        if x.dim() == 2:  # the models' case: the reshape/view round trip costs ~6 µs, ~120 calls a step
            out = kernel(x)
        else:
            out = kernel(x.reshape(-1, x.shape[-1]))
            out = out.view(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias


class SplitPackedMethod:
    """A merged projection (QKV, gate-up) whose parts keep their own packed formats, e.g. a GGUF
    file's q/k in Q4_K and v in Q6_K: each part is a packed linear layer of its own (``layer.parts``)
    and the outputs sit side by side. Why: one common format that holds every part exactly (int8
    by 16 with mins) reads 12 bits a weight where the parts read 4.5-6.6."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        raise TypeError("split packed weights are installed with install_split_packed_weight")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.cat([part.method.apply(part, x, None) for part in layer.parts], dim=-1)
        return out if bias is None else out + bias


def install_split_packed_weight(layer: LinearBase, parts: list[PackedWeight]) -> None:
    """Puts the packed parts of a merged projection into a built linear layer, each as its own packed
    linear layer (``SplitPackedMethod``), and frees the dense weight. The bias stays on the layer."""
    if layer.tp.size != 1:
        raise ValueError("packed weights are supported with tensor parallel size 1 only")
    sizes = [packed.shape[0] for packed in parts]
    if sum(sizes) != layer.out_features:
        raise ValueError(f"{type(layer).__name__}: packed parts of {sizes} rows, layer needs {layer.out_features}")
    dtype = layer.bias.dtype if layer.bias is not None else torch.float32
    modules = []
    for packed, size in zip(parts, sizes):
        part = LinearBase(layer.in_features, size, False, dtype, layer.tp, None)
        install_packed_weight(part, packed)
        modules.append(part)
    layer._parameters.pop("weight", None)
    layer.parts = nn.ModuleList(modules)
    layer.method = SplitPackedMethod()


def _layer_device(layer: nn.Module) -> torch.device:
    tensor = next(iter(layer.parameters()), None)
    return tensor.device if tensor is not None and not tensor.is_meta else torch.device("cpu")


def install_packed_weight(layer: LinearBase, packed: PackedWeight) -> None:
    """Puts an already-packed ``[out_features, in_features]`` weight into a built linear layer (a
    merged QKV / gate-up layer takes its parts concatenated along dim 0) and frees the dense weight.
    The bias, if any, stays a plain parameter. Tensor parallel size 1 only. The packed weight may
    have extra zero input columns (padding to a whole group); inputs are then zero-padded to match."""
    if layer.tp.size != 1:
        raise ValueError("packed weights are supported with tensor parallel size 1 only")
    n, k = packed.shape
    if n != layer.out_features or not layer.in_features <= k < layer.in_features + 128:
        raise ValueError(
            f"{type(layer).__name__}: packed weight has shape {(n, k)}, "
            f"layer needs {(layer.out_features, layer.in_features)}"
        )
    attach_packed(layer, packed, _layer_device(layer))
    layer.method = PackedLinearMethod()


class OnTheFlyQuantMethod(UnquantizedLinearMethod):
    """Loads a float weight like the unquantized method, then replaces it by its quantized form."""

    def __init__(self, kind: str, group_size: int | None) -> None:
        self.kind, self.group_size = kind, group_size
        # The LM head's logits format (ParallelLMHead): int8 per channel for the integer kinds; fp8's
        # kernel dequantizes slabs at batch sizes, where float32 logits are as fast.
        self.logits_quantization = "int8" if kind in ("int8", "int4") else None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.quantize_layer(layer)

    def quantize_layer(self, layer: nn.Module, hessian: torch.Tensor | None = None) -> PackedWeight:
        """Each weight rounded on its own, or, given the Hessian of the layer's calibration inputs
        (``llmctl.models.calibration``), by GPTQ against it. Returns the packed weight installed."""
        weight = layer.weight.data
        multiple = {"int4": self.group_size, "int8": 32, "fp8": 16}[self.kind]  # what the kernels take
        padding = -weight.shape[1] % multiple
        if padding:  # e.g. 172 intermediate features: pad to whole groups with zero columns
            weight = F.pad(weight, (0, padding))
        if hessian is None:
            packed = quantize(weight, self.kind, self.group_size)
        else:  # the padded columns' inputs are zero: dead rows/columns of H. Act-order for int4 only:
            # SmolLM2's KLD from float -37 % there (docs/benchmarks.md, "Quantized weights: quality"), mixed at 8 bits.
            packed = gptq_quantize(
                weight,
                F.pad(hessian.to(weight.device), (0, padding, 0, padding)),
                self.kind,
                self.group_size,
                act_order=self.kind == "int4",
            )
        install_packed_weight(layer, packed)
        return packed


def linear_method_for(kind: str, group_size: int = 64) -> LinearMethod | None:
    """The method every linear layer of a model gets for ``--quantization kind`` (None = plain).
    int8 is per output channel and fp8 per channel: ``group_size`` applies to int4 only."""
    if kind not in QUANTIZATION_KINDS:
        raise ValueError(f"unknown quantization {kind!r}; choose one of {', '.join(QUANTIZATION_KINDS)}")
    if kind == "none":
        return None
    if kind == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    return OnTheFlyQuantMethod(kind, group_size if kind == "int4" else None)
