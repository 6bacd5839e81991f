"""Quantized weights: packed formats, linear methods, and on-the-fly quantization.

Entry points: ``install_packed_weight`` / ``install_packed_embedding`` (loaders holding packed
tensors), ``linear_method_for`` (``--quantization``), ``quantize_int8/int4/fp8`` and
``weight_bytes`` (what a model's weights occupy)."""

from llmctl.layers.quantization.methods import (
    INT4_GROUP_SIZES,
    QUANTIZATION_KINDS,
    OnTheFlyQuantMethod,
    PackedLinearMethod,
    install_packed_weight,
    linear_method_for,
)
from llmctl.layers.quantization.params import validate_packed, weight_bytes
from llmctl.layers.quantization.quantize import quantize, quantize_fp8, quantize_int4, quantize_int8
from llmctl_kernels.packed_formats import PackedFp8, PackedInt4, PackedInt8, PackedWeight, dequantize


def install_packed_embedding(module, packed: PackedWeight) -> None:
    """A packed token table into a ``VocabParallelEmbedding`` (rows dequantized on lookup) or a
    ``ParallelLMHead`` (logits from the packed kernels). For tied embeddings call it on both with the
    same ``packed`` object: they then share its tensors (counted once by ``weight_bytes``)."""
    module.install_packed(packed)


__all__ = [
    "INT4_GROUP_SIZES",
    "QUANTIZATION_KINDS",
    "OnTheFlyQuantMethod",
    "PackedFp8",
    "PackedInt4",
    "PackedInt8",
    "PackedLinearMethod",
    "PackedWeight",
    "dequantize",
    "install_packed_embedding",
    "install_packed_weight",
    "linear_method_for",
    "quantize",
    "quantize_fp8",
    "quantize_int4",
    "quantize_int8",
    "validate_packed",
    "weight_bytes",
]
