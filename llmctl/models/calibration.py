"""``--calibration``: quantize a float checkpoint's linear layers by GPTQ against a text, at load.

Decoder layer by decoder layer, as the GPTQ reference does: the calibration windows' hidden states
go through one layer with its float weights while hooks sum each linear layer's input outer
products (its Hessian); the layer's weights are then quantized against them, and the windows go
through the quantized layer to become the next layer's inputs, so that each layer also corrects
the rounding of the layers before it. Only one layer's Hessians and the windows' hidden states are
held at a time.
"""

from __future__ import annotations

import sys
import time
from importlib import resources
from pathlib import Path

import torch

from llmctl.config import check_calibration_applies, format_size
from llmctl.errors import ConfigError
from llmctl.layers.linear import LinearBase
from llmctl.layers.ops import AttentionMetadata
from llmctl.models import calibration_cache as cache
from llmctl.models import calibration_store as store

BUILTIN_CALIBRATION = "builtin"
CALIBRATION_WINDOW = 256  # tokens per independent window (each a fresh prefill from position 0)
MIN_CALIBRATION_TOKENS = 64
PROGRESS_EVERY_S = 5.0
SCRATCH_BLOCK_SIZE = 16  # tokens per block of the scratch KV cache the windows attend through


def check_calibration(quantization: str, world_size: int = 1) -> None:
    """What the loaders check before reading a weight: the config's rule
    (``check_calibration_applies``), and that the GPTQ cache's settings can be read."""
    check_calibration_applies(quantization, world_size)
    if store.cache_dir() is not None:
        store.cache_size_limit()  # a value it cannot read fails now, not after the calibration


def calibration_text(source: str) -> str:
    """The text of ``--calibration``: a file, or ``builtin`` (six short English stories written for
    llmctl, ~1,000 words)."""
    if source == BUILTIN_CALIBRATION:
        return resources.files("llmctl.data").joinpath("calibration_stories.txt").read_text(encoding="utf-8")
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"--calibration {source}: no such file (give a text file, or {BUILTIN_CALIBRATION!r})")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--calibration {source}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def calibration_tokens(source: str, tokenizer) -> list[int]:
    """The ``--calibration`` text as token ids, checked before any weight is loaded."""
    token_ids = tokenizer.encode(calibration_text(source))
    if len(token_ids) < MIN_CALIBRATION_TOKENS:
        raise ConfigError(
            f"--calibration text is {len(token_ids)} tokens; GPTQ needs at least "
            f"{MIN_CALIBRATION_TOKENS} (a few thousand is better)"
        )
    return token_ids


def calibration_windows(token_ids: list[int], max_len: int, window: int = CALIBRATION_WINDOW) -> list[list[int]]:
    """The calibration tokens cut into windows of at most ``window`` (and the model's length)."""
    size = min(window, max_len)
    return [
        token_ids[start : start + size]
        for start in range(0, len(token_ids), size)
        if len(token_ids[start : start + size]) >= 2
    ]


def bind_scratch_kv(model, num_tokens: int, dtype: torch.dtype) -> None:
    """A KV cache for one sequence of up to ``num_tokens``, shared by every layer (they run one
    after the other; each writes its keys and values, then attends over them): what the attention
    kernels read through ``AttentionMetadata.single_prefill``'s block table."""
    layers = model.attention_layers()
    if not layers:
        return
    first, device = layers[0], model.model.embed_tokens.weight.device
    shape = (-(-num_tokens // SCRATCH_BLOCK_SIZE), SCRATCH_BLOCK_SIZE, first.num_kv_heads, first.head_dim)
    keys, values = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    for attn in layers:
        attn.key_cache, attn.value_cache = keys, values


def unbind_kv(model) -> None:
    for attn in model.attention_layers():
        attn.key_cache = attn.value_cache = None


def calibrate_quantization(model, token_ids: list[int], model_files: list[Path] = ()) -> int:
    """Quantizes every on-the-fly-quantized linear layer of ``model`` (float weights loaded, not yet
    processed) by GPTQ on ``token_ids`` (``calibration_tokens``), or installs what an earlier load
    of the same ``model_files`` with the same settings computed (``calibration_cache``); returns how
    many layers it quantized. The caller then runs ``model.process_weights_after_loading()``."""
    layers = cache.calibrated_layers(model)
    path = cache.cache_file(layers, model.model.embed_tokens.weight.dtype, list(model_files), token_ids)
    if path is not None and path.is_file():
        if cache.load_cached(layers, path):
            _say(f"GPTQ calibration: {len(layers)} linear layers from the cache ({path})")
            return len(layers)
        _say(f"GPTQ calibration: ignoring an unreadable or mismatched cache file ({path})")
    produced: dict[LinearBase, object] = {}  # the packed weights, before a kernel binding frees their rows
    quantized = calibrate_on_windows(
        model,
        calibration_windows(token_ids, model.config.max_position_embeddings),
        produced.__setitem__ if path is not None else None,
    )
    if path is not None:
        if reason := cache.save_cached({n: produced[m] for n, m in layers.items()}, path):
            _say(f"GPTQ calibration: not cached ({reason})")
        else:
            limit = store.cache_size_limit()
            deleted, freed = store.prune(path.parent, keep=path, limit=limit)
            if deleted:
                _say(
                    f"GPTQ calibration cache: removed {deleted} least recently used "
                    f"entr{'y' if deleted == 1 else 'ies'} ({format_size(freed)}) to stay under "
                    f"{format_size(limit)} (LLMCTL_GPTQ_CACHE_SIZE)"
                )
    return quantized


def calibrate_on_windows(model, windows: list[list[int]], on_quantized=None) -> int:
    """``calibrate_quantization`` on windows of token ids; ``on_quantized(layer, packed)`` sees each
    packed weight as it is made."""
    stage = model.model.stage
    if not (stage.is_first and stage.is_last):
        raise ConfigError("--calibration needs the whole model in one process (no pipeline stages)")
    embed = model.model.embed_tokens
    dtype, device = embed.weight.dtype, embed.weight.device
    bind_scratch_kv(model, max(len(ids) for ids in windows), dtype)
    quantized, layers = 0, model.model.stage_layers
    started = last_said = time.monotonic()
    _say(f"GPTQ calibration: {sum(map(len, windows))} tokens through {len(layers)} decoder layers")
    states = hessians = None
    try:
        # no_grad, not inference_mode: the packed weights made here must stay ordinary tensors
        with torch.no_grad():
            states = [
                (
                    torch.arange(len(ids), device=device),
                    AttentionMetadata.single_prefill(len(ids), SCRATCH_BLOCK_SIZE, device),
                    embed(torch.tensor(ids, device=device)),
                    None,
                )
                for ids in windows
            ]
            for index, layer in enumerate(layers):
                if time.monotonic() - last_said >= PROGRESS_EVERY_S:
                    last_said = time.monotonic()
                    _say(f"  ... layer {index + 1}/{len(layers)} ({last_said - started:.0f} s)")
                linears = list(cache.calibrated_layers(layer).values())
                hessians = _layer_hessians(layer, linears, states)
                for linear, hessian in zip(linears, hessians):
                    packed = linear.method.quantize_layer(linear, hessian)
                    if on_quantized is not None:
                        on_quantized(linear, packed)
                quantized += len(linears)
                if index + 1 < len(layers):  # the next layer's inputs, through this quantized one
                    states = [
                        (positions, meta, *layer(positions, hidden, residual, meta))
                        for positions, meta, hidden, residual in states
                    ]
    finally:
        unbind_kv(model)
        del states, hessians
        if device.type == "cuda":  # the engine sizes its KV pool from the free memory next
            torch.cuda.empty_cache()
    _say(f"GPTQ calibration: {quantized} linear layers in {time.monotonic() - started:.1f} s")
    return quantized


def _say(message: str) -> None:
    """Progress goes to stderr, as the kernel builds' does: stdout may be a completion being piped."""
    print(f"llmctl: {message}", file=sys.stderr, flush=True)


def _layer_hessians(layer: torch.nn.Module, linears: list[LinearBase], states: list) -> list[torch.Tensor]:
    """Per linear layer, the sum of ``x x^T`` over every calibration token's input to it (float32, as
    the GPTQ reference sums; a few thousand tokens lose nothing that the 1 % damping does not)."""
    device = next(iter(states))[2].device
    hessians = [torch.zeros(m.in_features, m.in_features, device=device) for m in linears]

    def accumulate(index: int):
        def hook(module, inputs):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            hessians[index].addmm_(x.t(), x)

        return hook

    handles = [m.register_forward_pre_hook(accumulate(i)) for i, m in enumerate(linears)]
    try:
        for positions, meta, hidden, residual in states:
            layer(positions, hidden, residual, meta)
    finally:
        for handle in handles:
            handle.remove()
    return hessians
