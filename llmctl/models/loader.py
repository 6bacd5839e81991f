"""Build a model from a Hugging Face directory: config.json plus one or several safetensors files.

Every failure names the file it came from: a missing shard, a corrupt header, a tensor whose
shape disagrees with config.json, a weight the checkpoint lacks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from llmctl.distributed import PipelineStage, TensorParallel
from llmctl.errors import ModelLoadError
from llmctl.layers.linear import LinearMethod, copy_checked
from llmctl.layers.moe import ExpertShard, PackedExpertWeights, expert_checkpoint_target
from llmctl.layers.ops import TorchOps
from llmctl.layers.quantization import linear_method_for
from llmctl.models import mxfp4
from llmctl.models.config import ModelConfig
from llmctl.models.registry import CausalLM, family_for

# Checkpoint tensors that are derived state, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no model.safetensors (or sharded *.safetensors with an index) found")
    for path in files:
        if not path.is_file():
            raise ModelLoadError(f"{path}: listed in {index.name} but missing")
    return files


def iterate_tensors(
    files: list[Path], keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Every tensor of the files, or those whose name ``keep`` accepts (the others are not read)."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if keep is None or keep(name):
                        yield path, name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(
                f"{path}: cannot read safetensors file ({exc}); it may be corrupt or truncated"
            ) from exc


def load_weights(
    model: CausalLM, model_dir: Path, tensors: Iterator[tuple[Path, str, torch.Tensor]] | None = None
) -> None:
    """Checkpoint tensors (by default the safetensors files in ``model_dir``; a GGUF loader passes
    its own, renamed) into the model's parameters, merged projections part by part."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    top_level = {child for child, _ in model.named_children()}  # ``model``, ``lm_head``
    if tensors is None:
        tensors = iterate_tensors(safetensors_files(model_dir))
    for path, name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if model.config.checkpoint_prefixes and (name := model.config.checkpoint_name(name)) is None:
            continue  # a multimodal checkpoint's vision tower or projector
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.split(".", 1)[0] not in top_level:  # a bare decoder's names (Qwen3Model: no ``model.``)
            name = f"model.{name}"
        if not model.owns_checkpoint_tensor(name):  # another pipeline stage's layer
            continue
        target, shard_id = name, None
        expert = expert_checkpoint_target(name)  # a mixture-of-experts block's tensor: stacked experts
        if expert is not None:
            target, shard_id = expert
        else:
            for ckpt_name, (merged_name, part) in model.packed_modules.items():
                if f".{ckpt_name}." in name:
                    target, shard_id = name.replace(f".{ckpt_name}.", f".{merged_name}."), part
                    break
        param = params.get(target)
        if param is None:
            raise ModelLoadError(f"{path}: tensor {name!r} does not belong to a {model.config.architecture}")
        merged = _merged_module_of(model, target) if shard_id is None else None
        try:
            if merged is not None:  # the checkpoint stores the merged matrix itself (Phi-3's qkv_proj)
                module_name, parts = merged
                for part, piece in zip(parts, split_fused(model.get_submodule(module_name), tensor, len(parts))):
                    param.weight_loader(param, piece, part)
                    loaded.add(f"{target}#{part}")
                continue
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                copy_checked(param.data, tensor, "weight")
            else:
                loader(param, tensor, shard_id)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: tensor {name!r} does not match config.json: {exc}") from exc
        if isinstance(shard_id, ExpertShard):
            loaded.update(f"{target}#{key}" for key in shard_id.keys(param.shape[0]))
        else:
            loaded.add(target if shard_id is None else f"{target}#{shard_id}")
    expected = expected_checkpoint_names(model)
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{model_dir}: checkpoint lacks weights: {shown}")


def _merged_module_of(model: CausalLM, param_name: str) -> tuple[str, list[str | int]] | None:
    """(module name, its part ids in order) when ``param_name`` is a merged projection's weight or
    bias, else None."""
    parts_of: dict[str, list[str | int]] = {}
    for merged, part in model.packed_modules.values():
        parts_of.setdefault(merged, []).append(part)
    module_name, _, _ = param_name.rpartition(".")
    merged = module_name.rpartition(".")[2]
    return (module_name, parts_of[merged]) if merged in parts_of else None


def split_fused(module: nn.Module, tensor: torch.Tensor, num_parts: int) -> list[torch.Tensor]:
    """A merged projection's checkpoint tensor (parts stacked along the output features, full size,
    not sharded) cut into its parts, each then loaded as if the checkpoint stored it alone."""
    tp_size = module.tp.size
    sizes = [size * tp_size for size in module.part_sizes]
    replicas = getattr(module, "kv_replicas", 1)  # QKV: KV heads replicated across ranks
    if replicas > 1:
        sizes = [sizes[0], *(size // replicas for size in sizes[1:])]
    if len(sizes) != num_parts or sum(sizes) != tensor.shape[0]:
        raise ValueError(
            f"merged tensor has {tensor.shape[0]} rows, expected {sum(sizes)} (parts of {', '.join(map(str, sizes))})"
        )
    return list(tensor.split(sizes, 0))


def expected_checkpoint_names(model: CausalLM) -> set[str]:
    """Every parameter, with merged projections counted once per part. Packed weights a loader
    installed before (a GGUF file's quantized tensors) are not checkpoint names."""
    names: set[str] = set()
    parts_of = {}
    for merged, part in model.packed_modules.values():
        parts_of.setdefault(merged, []).append(part)
    installed = {
        f"{module_name}.{field}"
        for module_name, module in model.named_modules()
        if getattr(module, "packed_format", None)
        for field in ("qweight", "scales", "mins")
    }
    for name, param in model.named_parameters():  # tied weights appear once
        if name in installed:
            continue
        expert_shards = getattr(param, "expert_shards", None)  # stacked experts: one name per expert and part
        if expert_shards is not None:
            names.update(f"{name}#{key}" for key in expert_shards)
            continue
        merged = next((m for m in parts_of if f".{m}." in name), None)
        names.update({f"{name}#{p}" for p in parts_of[merged]} if merged else {name})
    return names


def build_model(
    cfg: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    ops: TorchOps,
    tp: TensorParallel = TensorParallel(),
    linear_method: LinearMethod | None = None,
    stage: PipelineStage | None = None,
) -> CausalLM:
    """The registry's class for ``cfg.architecture``, with uninitialised weights on ``device``."""
    family = family_for(cfg.architecture)
    if family is None:  # ModelConfig.from_dict refuses these; a hand-made config may not have been
        raise ModelLoadError(f"{cfg.architecture} has no implementation in llmctl.models.registry")
    with torch.device(device):
        model = family.model_class()(cfg, dtype=dtype, ops=ops, tp=tp, linear_method=linear_method, stage=stage)
    return model.eval()


def install_packed_experts(model: CausalLM, name: str, weights: PackedExpertWeights, source: Path) -> None:
    """One layer's packed experts into its ``StackedExperts`` (``name``: ``<layer>.mlp.experts``)."""
    try:
        model.get_submodule(name).install_packed(weights)
    except (ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{source}: the experts of {name!r} do not fit the model: {exc}") from exc


def load_model(
    model_dir: Path,
    *,
    dtype: str,
    device: torch.device,
    ops: TorchOps,
    tp: TensorParallel = TensorParallel(),
    quantization: str = "none",
    quantization_group_size: int = 64,
    stage: PipelineStage | None = None,
    calibration: str | None = None,
    tokenizer_dir: Path | None = None,
) -> CausalLM:
    """``quantization`` auto keeps an MXFP4 checkpoint's experts packed (llmctl/models/mxfp4.py;
    tensor parallel size 1, else they are dequantized and sharded) and is none for any other;
    int8 | int4 | fp8 quantizes every linear layer once its float weights are loaded (an MXFP4
    checkpoint's experts stay packed as auto keeps them, unless GPTQ calibrates); the embedding
    stays in ``dtype``, the LM head too except with int8 and int4, where its logits come from a
    per-channel int8 copy (``ParallelLMHead.logits_quantization``). ``calibration`` (a text file
    or ``builtin``) rounds them by GPTQ on that text, tokenized by the tokenizer in
    ``tokenizer_dir`` (default: the model's)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: no such model directory")
    # an MXFP4 checkpoint's experts stay packed where they can run packed (one rank), whatever
    # quantizes the other layers; none dequantizes them, and so does GPTQ, which refuses experts
    keep_packed = tp.size == 1 and (quantization == "auto" or (quantization != "none" and calibration is None))
    quantization = "none" if quantization == "auto" else quantization
    calibration_ids = None
    if calibration is not None:  # the text and the tokenizer checked before any weight is read
        from llmctl.models.calibration import calibration_tokens, check_calibration
        from llmctl.tokenizer import Tokenizer

        check_calibration(quantization, tp.size)
        try:
            tokenizer = Tokenizer.from_dir(Path(tokenizer_dir or model_dir))
        except ModelLoadError as exc:
            raise ModelLoadError(f"--calibration needs the model's tokenizer: {exc}") from None
        calibration_ids = calibration_tokens(calibration, tokenizer)
    cfg = ModelConfig.from_dir(model_dir)
    run_dtype = cfg.resolve_dtype(dtype, device)
    model = build_model(
        cfg,
        dtype=run_dtype,
        device=device,
        ops=ops,
        tp=tp,
        linear_method=linear_method_for(quantization, quantization_group_size),
        stage=stage,
    )
    tensors = None
    if mxfp4.is_mxfp4(cfg.raw):
        files = safetensors_files(model_dir)
        if keep_packed:  # this stage's experts first, packed; the other tensors after them
            experts = iterate_tensors(
                files, lambda name: mxfp4.is_expert_tensor(name) and model.owns_checkpoint_tensor(name)
            )
            for path, name, weights in mxfp4.packed_expert_layers(experts):
                install_packed_experts(model, name, weights, path)
        rest = iterate_tensors(files, (lambda name: not mxfp4.is_expert_tensor(name)) if keep_packed else None)
        # any other MXFP4 blocks and scales dequantized to the run dtype as they are read
        tensors = mxfp4.dequantized_tensors(rest, run_dtype)
    with torch.no_grad():
        load_weights(model, model_dir, tensors)
    if calibration_ids is not None:
        from llmctl.models.calibration import calibrate_quantization

        calibrate_quantization(model, calibration_ids, [model_dir / "config.json", *model_dir.glob("*.safetensors")])
    model.process_weights_after_loading()
    return model


def init_random_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights (the dummy load format): normal(0, std) matrices, unit norms,
    zero biases, drawn from a CPU generator so every machine builds the same model."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
                param.copy_(values.to(param.dtype))
