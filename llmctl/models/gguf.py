"""Models from a GGUF file (llama.cpp's format): config, tokenizer and weights.

The file is read with ``gguf.GGUFReader`` (the format authors' reader; tensors stay memory-mapped).
Its metadata becomes a ``ModelConfig`` and a ``Tokenizer``; each tensor is renamed to the Hugging
Face name llmctl's model uses and goes through the same weight loader as a safetensors checkpoint.
Quantized tensors are repacked exactly into llmctl's shared packed formats (gguf_quants.py).

What differs between architectures is the registry's (``ModelFamily.gguf_*``): the tensor names
come from llama.cpp's own table for the architecture (``gguf.TensorNameMap``, what its converter
renames by), with the family's entries where that table is ambiguous; family metadata keys map to
config.json fields, and a family's ``gguf_config`` function (in its model module) fills in what
the file stores otherwise or not at all (Phi-3's LongRoPE factor tensors, Gemma's attention scale).

llama.cpp's converter interleaves the rows of Q and K per head for the ``llama``-like architectures
(its rotary pairs adjacent elements; llmctl, like transformers, rotates halves); the rows are put
back here, which is exact for packed weights too because whole rows move. Its Gemma converters store
every norm weight plus 1 (llama.cpp's norm has no ``1 + w``); the 1 is taken off again.

Mixture-of-experts files (``expert_count`` > 0; Mixtral is ``llama`` with experts) store each
layer's experts as stacked gate, up and down tensors ``[experts, out, in]``. With
``quantization="auto"``, a layer whose three stacks all repack (``gguf_quants.QUANTIZED_TYPES``,
MXFP4 included) keeps them packed: each expert's slice is whole blocks and repacks exactly as a
matrix does (``gguf_quants.repack_experts``), and the layer's ``StackedExperts.install_packed``
takes them (tensor parallel size 1); gpt-oss's expert biases go through its ``gguf_experts`` hook
alone. Otherwise (a float stack among them, ``--quantization none``), once a layer's are read the
family's ``gguf_experts`` function turns them, dequantized, into its checkpoint's stacked float
tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, GGUFReader, get_tensor_name_map

from llmctl.errors import ModelLoadError, UnsupportedModelError
from llmctl.layers.moe import PackedExpertWeights
from llmctl.layers.ops import TorchOps
from llmctl.layers.quantization import linear_method_for
from llmctl.models import gguf_quants
from llmctl.models.config import ModelConfig
from llmctl.models.gguf_reader import read_gguf
from llmctl.models.gguf_tokenizer import GGUFTokenizerError, build_gguf_tokenizer
from llmctl.models.loader import build_model, install_packed_experts, load_weights
from llmctl.models.registry import CausalLM, ModelFamily, family_for, family_for_gguf, gguf_architectures
from llmctl.tokenizer import Tokenizer
from llmctl_kernels.packed_formats import PackedWeight, dequantize

# The stacked expert tensors of a layer ([experts, out, in] each), as llama.cpp's table names them;
# a family's ``gguf_experts`` hook turns them into its checkpoint's tensors.
_EXPERTS = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
_EXPERT_WEIGHTS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
# Families whose experts are gate/up/down stacks (gpt-oss's with float biases beside them), which a
# quantized file keeps packed
_PACKED_EXPERT_HOOKS = ("gguf_expert_tensors", "gpt_oss_gguf_experts")
# llmctl's module names (its models keep transformers' checkpoint names). What each is called in a
# file of a given architecture is llama.cpp's own table (``gguf.TensorNameMap``, the converter's).
_HF_GLOBAL = ("model.embed_tokens", "model.norm", "lm_head")
_HF_LAYER = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "self_attn.sinks",
    # mixture-of-experts blocks: the router, a shared expert and its gate, the stacked experts
    "mlp.gate",
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
    "mlp.shared_expert_gate",
    *_EXPERTS,
)
# Parameters a checkpoint names without ``.weight``
_BARE_PARAMETERS = ("self_attn.sinks",)
# Small matrices of MoE blocks that are not linear layers of the packed kernels: read as float
_FLOAT_ONLY = ("mlp.gate", "mlp.router", "mlp.shared_expert_gate")
# Tensors that carry configuration, not weights: read into the config (rope scaling)
_CONFIG_TENSORS = tuple(
    f"{TENSOR_NAMES[t]}.weight"
    for t in (MODEL_TENSOR.ROPE_FREQS, MODEL_TENSOR.ROPE_FACTORS_LONG, MODEL_TENSOR.ROPE_FACTORS_SHORT)
)


@functools.cache
def tensor_names(gguf_architecture: str, experts: bool | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """(file name -> Hugging Face module) for the global tensors and, after ``blk.N.``, for those
    of each layer, in files of ``gguf_architecture`` (``experts``: with expert tensors): llmctl's
    names through llama.cpp's table for that architecture, then the family's own entries
    (``ModelFamily.gguf_tensors``) where the table gives one file name for several of ours (Phi-3's
    fused ``attn_qkv`` and ``ffn_up``, gpt-oss's router)."""
    arch = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}.get(gguf_architecture, MODEL_ARCH.LLAMA)
    table = get_tensor_name_map(arch, 1)
    global_names = {table.get_name(hf): hf for hf in _HF_GLOBAL if table.get_name(hf)}
    layer_names: dict[str, str] = {}
    for hf in _HF_LAYER:
        name = table.get_name(f"model.layers.0.{hf}")
        if name is not None:
            layer_names[name.removeprefix("blk.0.")] = hf
    family = family_for_gguf(gguf_architecture, experts)
    layer_names.update(family.gguf_tensors if family is not None else ())
    return global_names, layer_names


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


def _yarn_scaling(field: Callable[..., Any]) -> dict[str, Any]:
    """YaRN's parameters as llama.cpp's converter writes them (``rope.scaling.*``), back in
    transformers' ``rope_scaling`` names; the ones it leaves out keep transformers' defaults."""
    scaling: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": float(field("rope.scaling.factor")),
        "original_max_position_embeddings": int(field("rope.scaling.original_context_length")),
    }
    for key, name in (
        ("yarn_attn_factor", "attention_factor"),
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
    ):
        if (value := field(f"rope.scaling.{key}", None)) is not None:
            scaling[name] = float(str(np.float32(value)))
    return scaling


def gguf_config_dict(
    meta: dict[str, Any],
    tensor_names: set[str],
    path: Path,
    rope_freqs: list[float] | None = None,
    config_tensors: dict[str, list[float]] | None = None,
) -> dict[str, Any]:
    """The GGUF metadata as the Hugging Face config.json it stands for. ``config_tensors`` holds the
    values of the file's tensors that carry configuration (``rope_freqs.weight``, Phi-3's
    ``rope_factors_long/short.weight``); ``rope_freqs`` is the first of them, given alone."""
    arch = meta.get("general.architecture")
    expert_count = int(meta.get(f"{arch}.expert_count", 0) or 0)
    family = family_for_gguf(str(arch), expert_count > 0)
    if family is None and family_for_gguf(str(arch)) is not None:
        raise UnsupportedModelError(
            f"{path}: a {arch} GGUF {'with' if expert_count else 'without'} experts ({arch}.expert_count = "
            f"{expert_count}) is not a family llmctl reads; run the model's safetensors checkpoint"
        )
    if family is None:
        raise UnsupportedModelError(
            f"{path}: general.architecture {arch!r} is not supported; llmctl reads GGUF "
            f"architectures {', '.join(gguf_architectures())}"
        )
    config_tensors = dict(config_tensors or {})
    if rope_freqs is not None:
        config_tensors.setdefault("rope_freqs.weight", rope_freqs)

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
        "sliding_window": field("attention.sliding_window", None) or None,  # 0: none (Phi-3's converter)
    }
    if expert_count:  # layers without a router are dense (Qwen MoE's mlp_only_layers)
        cfg["num_experts"] = cfg["num_local_experts"] = expert_count
        cfg["num_experts_per_tok"] = int(field("expert_used_count"))
        layers = range(cfg["num_hidden_layers"])
        cfg["mlp_only_layers"] = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    if "rope_freqs.weight" in tensor_names:  # Llama 3.1+: llama.cpp stores the factors, not the parameters
        rope_freqs = config_tensors.get("rope_freqs.weight")
        if not rope_freqs or len(rope_freqs) != cfg["head_dim"] // 2:
            raise ModelLoadError(f"{path}: tensor 'rope_freqs.weight' has no {cfg['head_dim'] // 2} rope factors")
        cfg["rope_scaling"] = llama3_scaling_from_factors(rope_freqs, cfg["head_dim"], cfg["rope_theta"])
    scaling = field("rope.scaling.type", "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
    elif scaling == "yarn":
        cfg["rope_scaling"] = _yarn_scaling(field)
    elif scaling == "longrope" and "rope_factors_long.weight" in tensor_names:
        pass  # Phi-3's factor tensors, which its family's hook reads
    elif scaling != "none":
        raise ModelLoadError(f"{path}: {arch}.rope.scaling.type {scaling!r} is not supported (none, linear, yarn)")
    for key, name in family.gguf_metadata:
        if (value := field(key, None)) is not None:
            # a float32 in the file: the shortest decimal that gives it back, as config.json wrote it
            cfg[name] = float(str(np.float32(value))) if isinstance(value, float) else value
    hook: Callable[..., None] | None = family.gguf_config_hook()
    if hook is not None:
        try:
            hook(cfg, field, config_tensors)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: {exc}") from exc
    return cfg


def llama3_scaling_from_factors(factors: list[float], head_dim: int, base: float) -> dict[str, Any]:
    """Llama 3.1's rope scaling from the per-frequency factors llama.cpp's converter stores in
    ``rope_freqs.weight`` (its metadata keeps no parameters): ``factor`` is the long wavelengths'
    divisor; the smoothed band's factors fix the two wavelength bounds (``original / low_freq_factor``
    and ``original / high_freq_factor``), read with ``low_freq_factor`` 1 as every Llama 3.x has it.
    The parameters are kept only if they give back the stored factors bit for bit through the
    converter's own formula. Otherwise each inverse frequency is divided by its stored factor, as
    llama.cpp does (``freq_factors``): the same bits as transformers for the unscaled and the
    ``factor``-divided frequencies, within a rounding of it for a smoothed one (with fewer than two
    of those there is nothing to fit)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = max(factors)
    wavelens = [2 * math.pi / float(f) for f in inv_freq]
    medium = [(w, f) for w, f in zip(wavelens, factors) if f not in (1.0, factor)]
    if len(medium) >= 2 and factor > 1:
        # 1/f = (1 - s)/factor + s, s = (original/wavelen - low) / (high - low): linear in 1/wavelen
        (w1, f1), (w2, f2) = medium[0], medium[-1]
        s1, s2 = ((1 / f - 1 / factor) / (1 - 1 / factor) for f in (f1, f2))
        slope = (s2 - s1) / (1 / w2 - 1 / w1)  # original / (high - low)
        offset = slope / w1 - s1  # low / (high - low)
        original = round(slope / offset)  # with low = 1
        high = round(1 + original / slope, 6)
        scaling = {
            "rope_type": "llama3",
            "factor": float(factor),
            "low_freq_factor": 1.0,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
        if _converter_factors(inv_freq, scaling) == [float(np.float32(f)) for f in factors]:
            return scaling
    return {"rope_type": "llama3", "freq_factors": [float(f) for f in factors]}


def _converter_factors(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> list[float]:
    """convert_hf_to_gguf's ``rope_freqs`` values for ``scaling``, rounded to float32 as it stores them."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    out = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return [float(np.float32(float(f))) for f in out]


def rope_freqs_of(reader: GGUFReader) -> list[float] | None:
    """The values of the file's ``rope_freqs.weight`` (Llama 3.1+ rope factors), if it has one."""
    return config_tensors_of(reader).get("rope_freqs.weight")


def config_tensors_of(reader: GGUFReader) -> dict[str, list[float]]:
    """The values of the file's tensors that carry configuration, not weights (``_CONFIG_TENSORS``)."""
    return {
        tensor.name: [float(v) for v in gguf_quants.to_float(read_tensor(tensor)).flatten().tolist()]
        for tensor in reader.tensors
        if tensor.name in _CONFIG_TENSORS
    }


def _hf_name(gguf_name: str, gguf_architecture: str = "llama", experts: bool | None = None) -> str | None:
    """The Hugging Face name of a tensor of a ``gguf_architecture`` file (None: not a weight llmctl knows)."""
    global_names, layer_names = tensor_names(gguf_architecture, experts)
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        module = layer_names[parts[2]]
        if module in _BARE_PARAMETERS and parts[3] == "weight":
            return f"model.layers.{parts[1]}.{module}"
        return f"model.layers.{parts[1]}.{module}.{parts[3]}"
    if len(parts) == 2 and parts[0] in global_names:
        return f"{global_names[parts[0]]}.{parts[1]}"
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
    if len(shape) != 2 or tensor.tensor_type not in gguf_quants.QUANTIZED_TYPES:
        return gguf_quants.dequantized(raw, tensor.tensor_type, shape)  # stacked experts
    return gguf_quants.repack(raw, tensor.tensor_type, shape)


def iterate_gguf_tensors(
    reader: GGUFReader, cfg: ModelConfig, path: Path, family: ModelFamily, *, packed_experts: bool = False
) -> Iterator[tuple[str, PackedWeight | torch.Tensor | PackedExpertWeights]]:
    """(Hugging Face name, packed or dense tensor) for every weight, as the family's checkpoint holds
    it: Q/K rows restored where the converter interleaved them, the converter's norm offset taken off,
    each layer's stacked experts handed to the family's ``gguf_experts`` hook once all are read, or,
    with ``packed_experts`` where the family and the file's types allow, as
    ``("<layer>.mlp.experts", PackedExpertWeights)`` (module docstring)."""
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}
    experts = _ExpertTensors(reader, family, path)
    packable = packed_experts and family.gguf_experts in _PACKED_EXPERT_HOOKS
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_TENSORS:  # read into the config (rope scaling), not a weight
            continue
        name = _hf_name(tensor.name, str(family.gguf_architecture), family.gguf_experts is not None)
        if name is None:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} does not belong to a {cfg.architecture}")
        proj = name.split(".")[-2]
        order = None
        if family.gguf_interleaved_qk and proj in heads:
            order = _unpermute_order(int(tensor.shape[-1]), heads[proj]).numpy()
        try:
            if ".mlp.experts." in name:
                yield from experts.add(name, _read_experts(tensor, packable))
                continue
            value = read_tensor(tensor, order)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} cannot be read ({exc})") from exc
        if family.gguf_norm_offset and name.endswith("norm.weight"):
            # stored as w + offset in float32; subtracting it back is exact, so the model's 1 + w
            # gives back the very value stored (and transformers' fp32 1 + w on the checkpoint)
            value = gguf_quants.to_float(value) - family.gguf_norm_offset
        if name.rsplit(".", 1)[0].endswith(_FLOAT_ONLY):
            value = gguf_quants.to_float(value)
        yield name, value


def _read_experts(tensor: Any, packable: bool) -> list[PackedWeight] | torch.Tensor:
    """A stacked expert tensor: one packed weight per expert where ``packable`` and its type is
    packed (a 3-D stack), else float32."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if packable and len(shape) == 3 and tensor.tensor_type in gguf_quants.QUANTIZED_TYPES:
        return gguf_quants.repack_experts(tensor.data, tensor.tensor_type, shape)
    return gguf_quants.to_float(read_tensor(tensor))


class _ExpertTensors:
    """Collects each layer's stacked expert tensors (``mlp.experts.{gate,up,down}_proj`` weights and
    biases, ``[experts, out, in]`` / ``[experts, out]`` as the file holds them) until the file has
    no more of that layer, then hands them to the family's ``gguf_experts`` hook."""

    def __init__(self, reader: GGUFReader, family: ModelFamily, path: Path) -> None:
        self.hook = family.gguf_experts_hook()
        self.path = path
        self.expected: dict[str, int] = {}  # layer prefix -> its expert tensors in the file
        for tensor in reader.tensors:
            name = _hf_name(tensor.name, str(family.gguf_architecture), family.gguf_experts is not None)
            if name is not None and ".mlp.experts." in name:
                prefix = name.split(".experts.")[0]
                self.expected[prefix] = self.expected.get(prefix, 0) + 1
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def add(
        self, name: str, value: torch.Tensor | list[PackedWeight]
    ) -> Iterator[tuple[str, torch.Tensor | PackedExpertWeights]]:
        """``value``: the stack as float32, or one packed weight per expert (``_read_experts``).
        A layer whose gate, up and down all came packed is yielded packed (its biases, if any,
        through the hook); any other is dequantized and goes through the hook."""
        prefix, _, part = name.partition(".experts.")  # part: gate_proj.weight, down_proj.bias, ...
        if self.hook is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r}: this family has no experts")
        parts = self.pending.setdefault(prefix, {})
        parts[part] = value
        if len(parts) == self.expected[prefix]:
            del self.pending[prefix]
            if all(isinstance(parts.get(p), list) for p in _EXPERT_WEIGHTS):
                yield f"{prefix}.experts", PackedExpertWeights(*(parts.pop(p) for p in _EXPERT_WEIGHTS))
                if not parts:
                    return
            parts = {p: v if isinstance(v, torch.Tensor) else _stack_dequantized(v) for p, v in parts.items()}
            try:
                yield from self.hook(prefix, parts)
            except (KeyError, ValueError, RuntimeError) as exc:
                raise ModelLoadError(f"{self.path}: the experts of {prefix!r} cannot be read ({exc})") from exc


def _stack_dequantized(experts: list[PackedWeight]) -> torch.Tensor:
    """Per-expert packed weights back as the float32 stack (``dequantize`` is bit for bit gguf's)."""
    return torch.stack([dequantize(p) for p in experts])


def _install_packed_experts(
    model: CausalLM, tensors: Iterator[tuple[str, Any]], path: Path
) -> Iterator[tuple[str, PackedWeight | torch.Tensor]]:
    """Installs each layer's packed experts into its ``StackedExperts``; passes the rest on."""
    for name, value in tensors:
        if isinstance(value, PackedExpertWeights):
            install_packed_experts(model, name, value, path)
        else:
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
    cfg_dict = gguf_config_dict(meta, names, path, config_tensors=config_tensors_of(reader))
    cfg = ModelConfig.from_dict(cfg_dict, source=str(path))
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
    family = family_for(cfg.architecture)
    tensors = iterate_gguf_tensors(reader, cfg, path, family, packed_experts=quantization == "auto")
    with torch.no_grad():
        if quantization != "auto":
            rest = ((path, name, gguf_quants.to_float(value)) for name, value in tensors)
        else:
            from llmctl.models.gguf_packed import install_packed

            rest = install_packed(model, _install_packed_experts(model, tensors, path), path)
        load_weights(model, path, rest)
    if calibration_ids is not None:
        from llmctl.models.calibration import calibrate_quantization

        calibrate_quantization(model, calibration_ids, [path])
    model.process_weights_after_loading()
    return model, tokenizer
