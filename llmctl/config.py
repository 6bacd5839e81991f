"""Engine configuration: one dataclass, flags named as in vLLM where they mean the same.

Each field that a user can set carries its command-line flag and help in its metadata
(``metadata=cli(...)``); ``llmctl.cli_options.engine_options`` turns those into the options of
every command that runs an engine, so a new field with ``cli(...)`` metadata appears on all of
them at once and its default lives only here. torch is imported where it is needed, so that
commands which never run an engine start fast.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any

from llmctl.errors import ConfigError

if TYPE_CHECKING:
    import torch

EMBEDDED_MODEL_NAME = "tiny-random-llama"  # the embedded default model (llmctl.models.embedded)
GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 2 * GiB
DEFAULT_CUDA_MEMORY_FRACTION = 0.90
CLI_METADATA_KEY = "llmctl.cli"
QUANTIZED_AT_LOAD = ("int8", "int4", "fp8")  # --quantization kinds that quantize float weights while loading
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "kivi2", "kivi4")  # kernels/kv_quant.py implements them


@dataclass(frozen=True)
class CliOption:
    """How one ``EngineConfig`` field appears on the command line."""

    flag: str  # "--max-num-seqs"; "--name -n" adds a short alias; "--on/--off" for a boolean
    help: str
    parse: Callable[[Any], Any] | None = None  # what the user typed -> the field's value (e.g. "2GiB" -> bytes)
    cli_type: Any = None  # what the user types, when it is not the field's type


def cli(flag: str, help: str, *, parse: Callable[[Any], Any] | None = None, cli_type: Any = None) -> dict[str, Any]:
    """Field metadata that makes an ``EngineConfig`` field an engine option of every engine command."""
    return {CLI_METADATA_KEY: CliOption(flag, help, parse, cli_type)}


def parse_size(text: str | int | None) -> int | None:
    """``"2GiB"``, ``"512MB"``, ``"1.5G"`` or a byte count -> bytes."""
    if text is None or isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not match:
        raise ConfigError(f"cannot read memory size {text!r} (examples: 2GiB, 512MB, 1073741824)")
    number, unit, _ = match.groups()
    return int(float(number) * (1024 ** " kmgt".index(unit or " ")))


def check_calibration_applies(quantization: str, world_size: int = 1) -> None:
    """``--calibration`` rounds what ``--quantization`` quantizes at load, on one rank. The loaders
    ask too (``llmctl.models.calibration.check_calibration``): a library caller may load a model
    without a config."""
    if quantization not in QUANTIZED_AT_LOAD:
        raise ConfigError(
            f"--calibration applies to --quantization {' | '.join(QUANTIZED_AT_LOAD)} "
            f"(weights quantized while loading), not {quantization!r}"
        )
    if world_size != 1:
        raise ConfigError("--calibration runs on one rank: quantized weights are not sharded")


@dataclass
class EngineConfig:
    model: str = EMBEDDED_MODEL_NAME
    model_name: str | None = None  # how to show the model (a hub id) when ``model`` is its snapshot path
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = field(default="auto", metadata=cli("--dtype", "auto | float32 | bfloat16 | float16"))
    device: str = field(default="auto", metadata=cli("--device", "auto | cpu | cuda"))
    kernel_backend: str = field(
        default="auto",
        metadata=cli(
            "--kernel-backend",
            "auto | torch | triton: the kernels of every fused op (norms, rotary, SiLU, KV store, "
            "attention). auto: triton on CUDA, torch elsewhere (with the native CPU kernels); triton on a CPU runs "
            "Triton's interpreter.",
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=cli(
            "--max-model-len", "Context length limit, prompt + output (default: the model's, capped by the KV pool)."
        ),
    )
    max_num_seqs: int = field(default=256, metadata=cli("--max-num-seqs", "Most sequences in one batch."))
    max_num_batched_tokens: int = field(
        default=2048, metadata=cli("--max-num-batched-tokens", "Token budget of one step.")
    )
    block_size: int = field(default=16, metadata=cli("--block-size", "Tokens per KV block: 8, 16, 32, 64 or 128."))
    kv_cache_memory: int | None = field(
        default=None,
        metadata=cli(
            "--kv-cache-memory",
            "KV pool size, e.g. 2GiB (default: 2 GiB or a fifth of free RAM on a CPU; "
            "--memory-fraction of the GPU on CUDA).",
            parse=parse_size,
            cli_type=str,
        ),
    )
    memory_fraction: float = field(
        default=DEFAULT_CUDA_MEMORY_FRACTION, metadata=cli("--memory-fraction", "Share of GPU memory to use (CUDA).")
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=cli("--enable-prefix-caching/--no-prefix-caching", "Reuse KV blocks of shared prompt prefixes."),
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=cli("--enable-chunked-prefill/--no-chunked-prefill", "Split long prompts across steps.")
    )
    seed: int = field(default=0, metadata=cli("--seed", "Seed for requests that do not bring their own."))
    skip_tokenizer: bool = False  # token-id prompts only (benchmarks, tests of raw models)
    chat_template: str | None = field(
        default=None,
        metadata=cli(
            "--chat-template",
            "A Jinja chat template to render conversations with instead of the model's own: a file, "
            "or the template text.",
        ),
    )
    num_threads: int | None = field(
        default=None, metadata=cli("--threads", "CPU threads for torch (default: all cores).")
    )
    quantization: str = field(
        default="auto",
        metadata=cli(
            "--quantization",
            "auto | none | int8 | int4 | fp8. auto: a GGUF file keeps its quantized weights "
            "packed, an MXFP4 checkpoint its experts, a float checkpoint stays float; none: GGUF and "
            "MXFP4 weights are dequantized; int8/int4/fp8: "
            "quantize a float checkpoint's linear layers while loading (an MXFP4 checkpoint's other layers, "
            "its experts staying packed; the embedding stays float; with int8/int4 the LM head computes "
            "logits from an int8 copy on a CPU).",
        ),
    )
    quantization_group_size: int = field(
        default=64, metadata=cli("--quantization-group-size", "Inputs per int4 scale/zero group: 32, 64 or 128.")
    )
    quant_exact_activations: bool = field(
        default=False,
        metadata=cli(
            "--quant-exact-activations/--no-quant-exact-activations",
            "int4/int8 weights on a CPU: multiply the "
            "exact activations (dequantized weight slabs, torch's GEMM) instead of activations rounded to int16 per "
            "block of 32 (integer dot products, a row's result independent of its batch; the default). Slower.",
        ),
    )
    calibration: str | None = field(
        default=None,
        metadata=cli(
            "--calibration",
            "GPTQ for --quantization int8 | int4 | fp8: round each layer's weights so that its outputs "
            "on this text stay closest to the float layer's (a UTF-8 text file, or 'builtin': six short English "
            "stories shipped with llmctl). Loads slower; default: each weight rounded on its own.",
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=cli(
            "--kv-cache-dtype",
            "auto | fp8_e4m3 | fp8_e5m2 | int8 | kivi2 | kivi4. auto: the model dtype; fp8/int8: "
            "a scale per token and KV head; kivi2/kivi4: KIVI 2/4-bit codes, keys per channel over each block, values "
            "per token over --kv-quant-group-size channels, the last --kv-residual-length tokens at most in full "
            "precision.",
        ),
    )
    kv_quant_group_size: int = field(
        default=32,
        metadata=cli(
            "--kv-quant-group-size",
            "KIVI: value channels per scale/zero group (KIVI's default 32; capped at head_dim).",
        ),
    )
    kv_residual_length: int = field(
        default=128,
        metadata=cli(
            "--kv-residual-length",
            "KIVI: recent tokens kept in full precision (KIVI's R, default 128; a multiple of "
            "--block-size; 0 = the open block only). They are quantized R at a time, as KIVI does with keys.",
        ),
    )
    # ---- speculative decoding (llmctl/spec/) ----
    speculative_model: str | None = field(
        default=None,
        metadata=cli(
            "--speculative-model",
            "Draft tokens to verify in one forward: 'ngram' (prompt lookup: the tokens that "
            "followed the latest n-gram earlier in prompt + output), or a small draft model sharing the target's "
            "tokenizer (a directory, .gguf file or short name). Greedy output is unchanged; sampling keeps its "
            "distribution (rejection sampling).",
        ),
    )
    num_speculative_tokens: int = field(
        default=4,
        metadata=cli(
            "--num-speculative-tokens", "Draft tokens proposed per sequence per step (with --speculative-model)."
        ),
    )
    ngram_prompt_lookup_max: int = field(
        default=4,
        metadata=cli("--ngram-prompt-lookup-max", "Longest n-gram matched by --speculative-model ngram (tried first)."),
    )
    ngram_prompt_lookup_min: int = field(
        default=2, metadata=cli("--ngram-prompt-lookup-min", "Shortest n-gram matched by --speculative-model ngram.")
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=cli(
            "--tensor-parallel-size --tp",
            "Ranks that split every layer (attention heads, MLP, vocabulary); "
            "llmctl starts them through torchrun (docs/parallelism.md).",
        ),
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata=cli("--pipeline-parallel-size --pp", "Pipeline stages that split the layers; ranks = TP x PP."),
    )
    # ---- LoRA adapters (llmctl/lora/; llmctl serve's --enable-lora, --max-loras, --max-lora-rank) ----
    enable_lora: bool = False  # LoRA slots even with no adapter given (adapters loaded at run time)
    max_loras: int = 4  # most adapters in one batch: device slots for adapter weights
    max_lora_rank: int = 16  # largest rank an adapter may have (the slots' width)
    # "NAME=PATH" adapters loaded at start (llmctl serve --lora-modules)
    lora_modules: tuple[str, ...] = ()
    attention_backend: InitVar[str | None] = None  # the old name of kernel_backend, still accepted

    def __post_init__(self, attention_backend: str | None) -> None:
        if attention_backend is not None:
            warnings.warn(
                "EngineConfig(attention_backend=...) is now kernel_backend=...", DeprecationWarning, stacklevel=3
            )
            self.kernel_backend = attention_backend
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"threads must be at least 1, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.quantization not in ("auto", "none", *QUANTIZED_AT_LOAD):
            raise ConfigError(f"unknown quantization {self.quantization!r}; choose auto, none, int8, int4 or fp8")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"unknown KV cache dtype {self.kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.kv_quant_group_size not in (8, 16, 32, 64, 128):
            raise ConfigError(f"KV quant group size must be 8, 16, 32, 64 or 128, got {self.kv_quant_group_size}")
        if self.kv_residual_length < 0 or self.kv_residual_length % self.block_size:
            raise ConfigError(
                f"--kv-residual-length must be 0 or a multiple of --block-size ({self.block_size}), "
                f"got {self.kv_residual_length}"
            )
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ConfigError("tensor and pipeline parallel sizes must be at least 1")
        if self.kv_cache_dtype != "auto" and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ConfigError(
                "--kv-cache-dtype runs on one rank: it cannot be combined with tensor or pipeline parallelism yet"
            )
        if self.kv_cache_dtype.startswith("kivi") and self.speculative_model is not None:
            raise ConfigError(
                "--kv-cache-dtype kivi2/kivi4 cannot be combined with --speculative-model yet "
                "(a rejected draft may have completed, and so quantized, a block)"
            )
        if self.calibration is not None:
            check_calibration_applies(self.quantization, self.world_size)
        if self.quantization_group_size not in (32, 64, 128):
            raise ConfigError(f"quantization group size must be 32, 64 or 128, got {self.quantization_group_size}")
        if self.speculative_model is not None and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ConfigError(
                "--speculative-model runs on one rank: it cannot be combined with tensor or pipeline parallelism yet"
            )
        if self.speculative_model is not None and self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_prompt_lookup_min <= self.ngram_prompt_lookup_max:
            raise ConfigError(
                "ngram prompt lookup needs 1 <= --ngram-prompt-lookup-min <= --ngram-prompt-lookup-max, "
                f"got {self.ngram_prompt_lookup_min} and {self.ngram_prompt_lookup_max}"
            )

        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError(
                f"--max-loras and --max-lora-rank must be at least 1, got {self.max_loras}, {self.max_lora_rank}"
            )
        if self.lora_enabled and self.world_size > 1:
            raise ConfigError(
                "LoRA adapters run on one rank: they cannot be combined with tensor or pipeline parallelism yet"
            )

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def world_size(self) -> int:
        """Ranks this engine runs on: tensor-parallel x pipeline-parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def resolve_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"unknown device {self.device!r}; choose auto, cpu or cuda")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("--device cuda: this torch build sees no CUDA device (use --device cpu or auto)")
        return torch.device(self.device)


def format_size(n: int) -> str:
    """Bytes in the units ``--kv-cache-memory`` reads back: ``36KiB``, ``1.5GiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n}B"


def kv_pool_too_small(pool_bytes: int, block_bytes: int, block_size: int, max_model_len: int | None) -> ConfigError:
    """The error for a KV pool that cannot hold one sequence, naming the smallest pool that can:
    ``max_model_len`` tokens when it was given, else one block (then max_model_len is one block)."""
    tokens = max_model_len if max_model_len else block_size
    needed = -(-tokens // block_size) * block_bytes
    what = f"one sequence of max_model_len={max_model_len} tokens" if max_model_len else "a single KV block"
    return ConfigError(
        f"a KV pool of {format_size(pool_bytes)} cannot hold {what} ({format_size(block_bytes)} per block of "
        f"{block_size} tokens for this model): give --kv-cache-memory at least {format_size(needed)}"
        + (" or lower --max-model-len" if max_model_len else "")
    )


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
        import torch

        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(0, int(total * config.memory_fraction) - used)
    return min(DEFAULT_CPU_KV_CACHE_BYTES, available_host_memory() // 5)
