"""Llama-family models from a GGUF file (llama.cpp's format): config, tokenizer and weights.

The file is read with ``gguf.GGUFReader`` (the format authors' reader; tensors stay memory-mapped).
Its metadata becomes a ``ModelConfig`` and a ``Tokenizer``; each tensor is renamed to the Hugging
Face name llmctl's model uses and goes through the same weight loader as a safetensors checkpoint.
Quantized tensors are repacked exactly into llmctl's shared packed formats (gguf_quants.py).

llama.cpp's converter interleaves the rows of Q and K per head for the ``llama`` architecture (its
rotary pairs adjacent elements; llmctl, like transformers, rotates halves); the rows are put back
here, which is exact for packed weights too because whole rows move.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader

from llmctl.errors import ModelLoadError, UnsupportedModelError
from llmctl.layers.ops import TorchOps
from llmctl.layers.quantization import linear_method_for
from llmctl.models import gguf_quants
from llmctl.models.config import ModelConfig
from llmctl.models.gguf_reader import read_gguf
from llmctl.models.gguf_tokenizer import GGUFTokenizerError, build_gguf_tokenizer
from llmctl.models.loader import build_model, load_weights
from llmctl.models.registry import CausalLM, family_for_gguf, gguf_architectures
from llmctl.tokenizer import Tokenizer
from llmctl_kernels.packed_formats import PackedWeight

# GGUF tensor name (after ``blk.N.``) -> Hugging Face module path inside ``model.layers.N.``
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def open_gguf(path: Path) -> GGUFReader:
    """The file's reader, once every tensor is of a type llmctl reads."""
    reader = read_gguf(path)
    for tensor in reader.tensors:
        if tensor.tensor_type not in gguf_quants.SUPPORTED_TYPES:
            supported = ", ".join(t.name for t in gguf_quants.SUPPORTED_TYPES)
            raise ModelLoadError(
                f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                f"which llmctl does not read (supported: {supported})"
            )
    return reader


def read_metadata(reader: GGUFReader, path: Path) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path}: metadata field {key!r} is malformed ({exc})") from exc
    return meta


def gguf_config_dict(meta: dict[str, Any], tensor_names: set[str], path: Path) -> dict[str, Any]:
    """The GGUF metadata as the Hugging Face config.json it stands for."""
    arch = meta.get("general.architecture")
    family = family_for_gguf(str(arch))
    if family is None:
        raise UnsupportedModelError(
            f"{path}: general.architecture {arch!r} is not supported; llmctl reads GGUF "
            f"architectures {', '.join(gguf_architectures())}"
        )

    def field(name: str, default: Any = ...) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is ...:
            raise ModelLoadError(f"{path}: metadata field '{arch}.{name}' is missing")
        return value

    heads = int(field("attention.head_count"))
    hidden = int(field("embedding_length"))
    vocab = field("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens", ()))
    cfg: dict[str, Any] = {
        "architectures": [family.architecture],
        "hidden_size": hidden,
        "intermediate_size": int(field("feed_forward_length")),
        "num_hidden_layers": int(field("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field("attention.head_count_kv", heads)),
        "head_dim": int(field("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(field("context_length")),
        "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field("rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "sliding_window": meta.get(f"{arch}.attention.sliding_window"),
    }
    scaling = field("rope.scaling.type", "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
    elif scaling != "none":
        raise ModelLoadError(f"{path}: {arch}.rope.scaling.type {scaling!r} is not supported (none, linear)")
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(f"{path}: tensor 'rope_freqs.weight' (Llama 3 rope scaling factors) is not supported")
    return cfg


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    return None


def _unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's per-head interleave (convert_hf_to_gguf ``permute``)."""
    return torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1).argsort()


def read_tensor(tensor: Any, row_order: np.ndarray | None = None) -> PackedWeight | torch.Tensor:
    """A GGUF tensor in torch order (output features first): packed when quantized. ``row_order``
    reorders the output rows while still raw bytes (a quantized row is whole blocks, so this is exact
    and costs the one copy that reading makes anyway)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    raw = tensor.data if row_order is None else tensor.data[row_order]
    if tensor.tensor_type in gguf_quants.DENSE_TYPES:
        return gguf_quants.dense(raw, tensor.tensor_type, shape)
    if len(shape) != 2:
        raise ValueError(f"a quantized tensor must be a matrix, got shape {shape}")
    return gguf_quants.repack(raw, tensor.tensor_type, shape)


def iterate_gguf_tensors(
    reader: GGUFReader, cfg: ModelConfig, path: Path, interleaved_qk: bool
) -> Iterator[tuple[str, PackedWeight | torch.Tensor]]:
    """(Hugging Face name, packed or dense tensor) for every weight, Q/K rows restored."""
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} does not belong to a {cfg.architecture}")
        proj = name.split(".")[-2]
        order = None
        if interleaved_qk and proj in heads:
            order = _unpermute_order(int(tensor.shape[-1]), heads[proj]).numpy()
        try:
            value = read_tensor(tensor, order)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} cannot be read ({exc})") from exc
        yield name, value


def gguf_tokenizer(path: Path, meta: dict[str, Any] | None = None) -> Tokenizer:
    """The tokenizer a GGUF file describes (its metadata is read when not given)."""
    meta = read_metadata(open_gguf(path), path) if meta is None else meta
    try:
        return build_gguf_tokenizer(meta, source=str(path))
    except (GGUFTokenizerError, KeyError, TypeError, IndexError) as exc:
        raise ModelLoadError(f"{path}: cannot build the tokenizer: {exc}") from exc


def load_gguf(
    path: str | Path,
    *,
    dtype: str,
    device: torch.device,
    ops: TorchOps,
    with_tokenizer: bool = True,
    quantization: str = "auto",
    calibration: str | None = None,
) -> tuple[CausalLM, Tokenizer | None]:
    """Model and tokenizer from one GGUF file. ``quantization="auto"`` keeps the file's quantized
    tensors packed in memory (computed by the packed kernels); ``"none"`` dequantizes every weight
    to ``dtype`` (float32 unless asked), the path that matches transformers exactly; ``"int8"``
    (per channel) dequantizes, then quantizes the linear layers on the fly as for a float
    checkpoint (the file's 4-bit grid re-rounded to int8 per output channel), by GPTQ on the
    ``calibration`` text if one is given (``llmctl.models.calibration``)."""
    if quantization not in ("auto", "none", "int8"):
        raise ModelLoadError(
            f"{path}: a GGUF file is already quantized; --quantization {quantization} applies to "
            "float checkpoints (use none to dequantize it, or int8)"
        )
    if calibration is not None:
        from llmctl.models.calibration import check_calibration

        check_calibration(quantization)  # the text itself is read with the tokenizer, before the weights
    path = Path(path)
    reader = open_gguf(path)
    meta = read_metadata(reader, path)
    names = {t.name for t in reader.tensors}
    cfg = ModelConfig.from_dict(gguf_config_dict(meta, names, path), source=str(path))
    tokenizer = gguf_tokenizer(path, meta) if with_tokenizer or calibration is not None else None
    calibration_ids = None
    if calibration is not None:
        from llmctl.models.calibration import calibration_tokens

        calibration_ids = calibration_tokens(calibration, tokenizer)
        tokenizer = tokenizer if with_tokenizer else None
    model = build_model(
        cfg,
        dtype=cfg.resolve_dtype(dtype, device),
        device=device,
        ops=ops,
        linear_method=linear_method_for(quantization) if quantization == "int8" else None,
    )
    interleaved_qk = family_for_gguf(str(meta.get("general.architecture"))).gguf_interleaved_qk
    tensors = iterate_gguf_tensors(reader, cfg, path, interleaved_qk)
    with torch.no_grad():
        if quantization != "auto":
            rest = ((path, name, gguf_quants.to_float(value)) for name, value in tensors)
        else:
            from llmctl.models.gguf_packed import install_packed

            rest = install_packed(model, tensors, path)
        load_weights(model, path, rest)
    if calibration_ids is not None:
        from llmctl.models.calibration import calibrate_quantization

        calibrate_quantization(model, calibration_ids, [path])
    model.process_weights_after_loading()
    return model, tokenizer
