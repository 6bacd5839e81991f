"""Every environment variable llmctl reads, declared once: its type, its default and what it does.

Read at access time (``envs.LLMCTL_NATIVE_GEMM`` parses the variable as it is now), so a test's
``monkeypatch.setenv`` or a benchmark's ``os.environ[...] = ...`` takes effect without a reload.
A value that cannot be read is a ``ConfigError`` naming the variable and what it accepts.

Settings that change what a model computes are ``EngineConfig`` fields, not variables: the ones
here are switches that leave every result bit-identical (A/B comparisons of kernels and layouts),
places on disk, and the knobs of the parallel and router processes that reach them as variables.
docs/environment.md lists them (tests/test_envs.py checks that it matches ``VARIABLES``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmctl.errors import ConfigError

if TYPE_CHECKING:  # what each name below reads as (for type checkers; values come from __getattr__)
    LLMCTL_NATIVE_CPU_KERNELS: bool
    LLMCTL_NATIVE_GEMM: str
    LLMCTL_DECODE_LOOP: bool
    LLMCTL_CPU_ISA: str | None
    LLMCTL_QUANT_INTERLEAVE: bool
    LLMCTL_QUANT_HALF_SCALES: bool
    LLMCTL_QUANT_STEPPED_SCALES: bool
    LLMCTL_MOE_NATIVE: bool
    LLMCTL_GPTQ_CACHE: Path | None
    LLMCTL_GPTQ_CACHE_SIZE: str
    LLMCTL_PP_LAYER_PARTITION: str | None
    LLMCTL_PP_MICRO_BATCHES: int | None
    LLMCTL_PP_MICRO_BATCH_MIN_TOKENS: int
    LLMCTL_PP_BATCHES_IN_FLIGHT: int | None
    LLMCTL_ROUTER_REPLICAS: list[str]
    LLMCTL_ROUTER_DISCOVER: str | None
    LLMCTL_API_KEY: str | None

CPU_ISA_LEVELS = ("generic", "avx2", "avx512", "avx512bf16")  # llmctl_kernels.cpu_features.ISA_LEVELS, lowest first
NATIVE_GEMM_SETTINGS = ("auto", "0", "1")
DEFAULT_MICRO_BATCH_MIN_TOKENS = 256
DEFAULT_GPTQ_CACHE_SIZE = "8GiB"
# Names for code that hands a variable to something else to read (typer's ``envvar=``, a child's environment).
API_KEY_ENV = "LLMCTL_API_KEY"
ROUTER_DISCOVER_ENV = "LLMCTL_ROUTER_DISCOVER"


@dataclass(frozen=True)
class EnvVar:
    """One variable: ``parse`` turns its text (None when unset) into the typed value."""

    name: str
    type: str  # as docs/environment.md shows it
    default: str  # as docs/environment.md shows it
    help: str
    parse: Callable[[str | None], Any]


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/llmctl`` (``~/.cache/llmctl`` by default): the root of llmctl's caches."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmctl"


def _switch(name: str, default: bool) -> Callable[[str | None], bool]:
    def parse(text: str | None) -> bool:
        if text is None or text.strip() == "":
            return default
        value = text.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}={text!r}: choose 1 or 0")

    return parse


def _choice(name: str, choices: tuple[str, ...], default: str | None) -> Callable[[str | None], str | None]:
    def parse(text: str | None) -> str | None:
        if text is None or text.strip() == "":
            return default
        if text.strip() not in choices:
            raise ConfigError(f"{name}={text!r}: choose {', '.join(choices[:-1])} or {choices[-1]}")
        return text.strip()

    return parse


def _number(name: str, kind: type, default: Any, minimum: float) -> Callable[[str | None], Any]:
    def parse(text: str | None) -> Any:
        if text is None or text.strip() == "":
            return default
        try:
            value = kind(text)
        except ValueError:
            raise ConfigError(f"{name}={text!r}: not a{'n integer' if kind is int else ' number'}") from None
        if value < minimum:
            raise ConfigError(f"{name}={text!r}: must be at least {minimum:g}")
        return value

    return parse


def _text(text: str | None) -> str | None:
    return text if text else None


def _gptq_cache(text: str | None) -> Path | None:
    if text == "0":
        return None
    return Path(text) if text else user_cache_dir() / "gptq"


def _words(text: str | None) -> list[str]:
    return (text or "").replace(",", " ").split()


VARIABLES: dict[str, EnvVar] = {
    var.name: var
    for var in [
        # ---- kernel switches: each pair of settings computes the same bits (A/B runs, diagnosis) ----
        EnvVar(
            "LLMCTL_NATIVE_CPU_KERNELS",
            "bool",
            "1",
            "0 turns every native C++ CPU kernel off (fused ops, quantized linear, quantized KV, panel GEMM, "
            "decode loop): the torch references run instead.",
            _switch("LLMCTL_NATIVE_CPU_KERNELS", True),
        ),
        EnvVar(
            "LLMCTL_NATIVE_GEMM",
            "auto, 0, 1",
            "auto",
            "fp32 linear layers on the native panel GEMM: auto = on for AVX2 and better, 1 = on, 0 = torch's GEMM.",
            _choice("LLMCTL_NATIVE_GEMM", NATIVE_GEMM_SETTINGS, "auto"),
        ),
        EnvVar(
            "LLMCTL_DECODE_LOOP",
            "bool",
            "1",
            "0 runs decode-only steps through the Python modules instead of the native decode loop "
            "(the same logits, bit for bit; per-op timing needs the module path).",
            _switch("LLMCTL_DECODE_LOOP", True),
        ),
        EnvVar(
            "LLMCTL_CPU_ISA",
            "generic, avx2, avx512, avx512bf16",
            "(the CPU's best)",
            "Caps the CPU kernels' instruction set below what the CPU has (emulating a smaller CPU); "
            "--dtype auto then chooses as on that CPU.",
            _choice("LLMCTL_CPU_ISA", CPU_ISA_LEVELS, None),
        ),
        EnvVar(
            "LLMCTL_QUANT_INTERLEAVE",
            "bool",
            "1",
            "0 keeps int4/int8 weights in their row layout instead of the tile-interleaved copy the CPU kernels "
            "read faster (same bits).",
            _switch("LLMCTL_QUANT_INTERLEAVE", True),
        ),
        EnvVar(
            "LLMCTL_QUANT_HALF_SCALES",
            "bool",
            "1",
            "0 makes the CPU kernels read float32 scales and mins where float16 copies would be exact (same bits, "
            "more bytes a step).",
            _switch("LLMCTL_QUANT_HALF_SCALES", True),
        ),
        EnvVar(
            "LLMCTL_QUANT_STEPPED_SCALES",
            "bool",
            "1",
            "0 keeps float32 (or float16) scales in the CPU kernels' tiles where an int8 per group times a float32 "
            "step per 256 inputs would be exact, as GGUF's K-quants are (same bits, more bytes a step).",
            _switch("LLMCTL_QUANT_STEPPED_SCALES", True),
        ),
        EnvVar(
            "LLMCTL_MOE_NATIVE",
            "bool",
            "1",
            "0 runs packed mixture-of-experts layers on the CPU expert by expert from Python instead of in one "
            "native call per layer (same bits).",
            _switch("LLMCTL_MOE_NATIVE", True),
        ),
        # ---- places on disk ----
        EnvVar(
            "LLMCTL_GPTQ_CACHE",
            "path, or 0",
            "$XDG_CACHE_HOME/llmctl/gptq",
            "Where --calibration keeps GPTQ-rounded weights for reuse; 0 keeps none.",
            _gptq_cache,
        ),
        EnvVar(
            "LLMCTL_GPTQ_CACHE_SIZE",
            "size",
            DEFAULT_GPTQ_CACHE_SIZE,
            "Most bytes the GPTQ cache holds (2GiB, 500MB, a byte count); the least recently used entries go first.",
            lambda text: text or DEFAULT_GPTQ_CACHE_SIZE,
        ),
        # ---- pipeline parallelism (torchrun's children read them too) ----
        EnvVar(
            "LLMCTL_PP_LAYER_PARTITION",
            "list of int",
            "(even split)",
            "Decoder layers per pipeline stage, e.g. 3,2.",
            _text,
        ),
        EnvVar(
            "LLMCTL_PP_MICRO_BATCHES",
            "int",
            "(the number of stages)",
            "Micro-batches a pipeline step is split into.",
            _number("LLMCTL_PP_MICRO_BATCHES", int, None, 1),
        ),
        EnvVar(
            "LLMCTL_PP_MICRO_BATCH_MIN_TOKENS",
            "int",
            str(DEFAULT_MICRO_BATCH_MIN_TOKENS),
            "Fewest tokens a micro-batch gets: a step with fewer tokens is split into fewer micro-batches.",
            _number("LLMCTL_PP_MICRO_BATCH_MIN_TOKENS", int, DEFAULT_MICRO_BATCH_MIN_TOKENS, 1),
        ),
        EnvVar(
            "LLMCTL_PP_BATCHES_IN_FLIGHT",
            "int",
            "(the number of stages)",
            "Batches in the pipeline at once; 1 ends each step when its logits are back.",
            _number("LLMCTL_PP_BATCHES_IN_FLIGHT", int, None, 1),
        ),
        # ---- servers and router (the flag wins over the variable) ----
        EnvVar(
            "LLMCTL_ROUTER_REPLICAS",
            "list of URL",
            "(none)",
            "llmctl router: the replicas' base URLs, comma- or space-separated (--replica).",
            _words,
        ),
        EnvVar(
            ROUTER_DISCOVER_ENV,
            "NAME:PORT",
            "(none)",
            "llmctl router: a Kubernetes headless Service whose addresses are the replicas (--discover).",
            _text,
        ),
        EnvVar(
            API_KEY_ENV,
            "str",
            "(none)",
            "serve and router: the key /v1/* requires; bench and top: the key they send (--api-key).",
            _text,
        ),
    ]
}


def __getattr__(name: str) -> Any:
    """``envs.NAME``: the variable's current value, parsed."""
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.parse(os.environ.get(name))


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


def is_set(name: str) -> bool:
    """Whether the user set this declared variable (a non-empty value)."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not declared in llmctl/envs.py")
    return bool(os.environ.get(name))


def markdown_table() -> str:
    """The table of docs/environment.md (``python -m llmctl.envs`` prints it)."""
    rows = ["| Variable | Type | Default | What it does |", "|---|---|---|---|"]
    for var in VARIABLES.values():
        rows.append(f"| `{var.name}` | {var.type} | {var.default} | {var.help} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
