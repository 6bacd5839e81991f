"""Engine configuration: one dataclass, flags named as in vLLM where they mean the same."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from llmctl.errors import ConfigError
from llmctl.models.embedded import EMBEDDED_MODEL_NAME

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 2 * GiB
DEFAULT_CUDA_MEMORY_FRACTION = 0.90


@dataclass
class EngineConfig:
    model: str = EMBEDDED_MODEL_NAME
    model_name: str | None = None  # how to show the model (a hub id) when ``model`` is its snapshot path
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"  # auto | torch | triton
    max_model_len: int | None = None  # default: the model's max_position_embeddings (capped by the KV pool)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV pool; default: see resolve_kv_cache_bytes
    memory_fraction: float = DEFAULT_CUDA_MEMORY_FRACTION  # of total GPU memory, on CUDA
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    skip_tokenizer: bool = False  # token-id prompts only (benchmarks, tests of raw models)
    num_threads: int | None = None  # CPU threads for torch; default: all cores
    quantization: str = "none"  # none | int8 | int4 | fp8: quantize linear layers while loading
    quantization_group_size: int = 64  # inputs per int4 scale/zero group: 32 | 64 | 128

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"threads must be at least 1, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.quantization not in ("none", "int8", "int4", "fp8"):
            raise ConfigError(f"unknown quantization {self.quantization!r}; choose none, int8, int4 or fp8")
        if self.quantization_group_size not in (32, 64, 128):
            raise ConfigError(f"quantization group size must be 32, 64 or 128, got {self.quantization_group_size}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"unknown device {self.device!r}; choose auto, cpu or cuda")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("--device cuda: this torch build sees no CUDA device (use --device cpu or auto)")
        return torch.device(self.device)


def parse_size(text: str | int | None) -> int | None:
    """``"2GiB"``, ``"512MB"``, ``"1.5G"`` or a byte count -> bytes."""
    if text is None or isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not match:
        raise ConfigError(f"cannot read memory size {text!r} (examples: 2GiB, 512MB, 1073741824)")
    number, unit, _ = match.groups()
    return int(float(number) * (1024 ** " kmgt".index(unit or " ")))


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def resolve_kv_cache_bytes(config: EngineConfig, device: torch.device) -> int:
    """An explicit budget wins; on CUDA the pool takes ``memory_fraction`` of the GPU minus what is
    already in use (the weights); on a CPU it takes 2 GiB or a fifth of available memory, whichever
    is smaller."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(0, int(total * config.memory_fraction) - used)
    return min(DEFAULT_CPU_KV_CACHE_BYTES, available_host_memory() // 5)
