"""``llmctl bench``: load-test the in-process engine or an OpenAI-compatible server and say whether
it meets the service goals (P99 TTFT under 500 ms, at least 30 tokens/s per stream)."""

from __future__ import annotations

import math
import sys
from collections.abc import Collection, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from llmctl import envs
from llmctl.bench import DEFAULT_NUM_PROMPTS
from llmctl.cli_options import RemoteMode, engine_options, exit_on_error, given_on_command_line
from llmctl.config import EMBEDDED_MODEL_NAME, EngineConfig
from llmctl.models.gguf_files import SMOLLM2_NAME

WORKLOAD = "Workload"
LOAD = "Load"
TARGET = "Target"
REPORT = "Report"
IN_PROCESS = " (in process, not with --url)"


def register_commands(app: typer.Typer) -> None:
    app.command(name="bench")(bench)


def _runs_no_engine(params: Mapping[str, Any]) -> bool:
    return params["url"] is not None


def _used_with_url(params: Mapping[str, Any]) -> Collection[str]:
    """--threads sizes the client (and the baseline); --dtype is the transformers baseline's."""
    return ("num_threads", "dtype") if params["baseline"] else ("num_threads",)


@engine_options(
    exclude=("seed", "chat_template"),
    panel_note=IN_PROCESS,
    helps={
        "max_model_len": "Context length limit of the in-process engine.",
        "num_threads": "CPU threads for torch: the engine's, the baseline's, with --url the client's "
        "(default: all cores).",
        "dtype": "auto | float32 | bfloat16 | float16 (with --url: the --baseline's).",
    },
    remote=RemoteMode(
        _runs_no_engine,
        "{flag} and --url: the server at --url runs with its own settings (engine options apply to in-process runs)",
        _used_with_url,
    ),
)
def bench(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Argument(
            metavar="MODEL",
            help=f"In process: the model to run (default: {SMOLLM2_NAME!r} when its package is installed, else "
            f"{EMBEDDED_MODEL_NAME!r}, random weights; no download; at 8 or more streams on a CPU with native "
            "bf16 the default GGUF runs as a bf16 copy, faster there, unless --quantization is given). With "
            f"--url: the model whose tokenizer builds the prompts (default {EMBEDDED_MODEL_NAME!r}).",
            show_default=False,
        ),
    ] = None,
    url: Annotated[
        str | None,
        typer.Option(
            "--url",
            help="Benchmark this OpenAI-compatible server "
            "(e.g. http://127.0.0.1:8000) instead of the in-process engine.",
            rich_help_panel=TARGET,
        ),
    ] = None,
    served_model_name: Annotated[
        str | None,
        typer.Option(
            "--served-model-name",
            help="Model name to send with --url (default: the first of /v1/models).",
            rich_help_panel=TARGET,
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", envvar=envs.API_KEY_ENV, help="Bearer token for --url.", rich_help_panel=TARGET),
    ] = None,
    dataset: Annotated[
        str, typer.Option("--dataset", help="random | shared-prefix | sharegpt", rich_help_panel=WORKLOAD)
    ] = "random",
    dataset_path: Annotated[
        Path | None, typer.Option("--dataset-path", help="ShareGPT-format JSON file.", rich_help_panel=WORKLOAD)
    ] = None,
    num_prompts: Annotated[
        int, typer.Option("--num-prompts", help="Requests in the timed run.", rich_help_panel=WORKLOAD)
    ] = DEFAULT_NUM_PROMPTS,
    input_len: Annotated[
        int,
        typer.Option(
            "--input-len", help="Prompt tokens (random; the suffix for shared-prefix).", rich_help_panel=WORKLOAD
        ),
    ] = 128,
    output_len: Annotated[
        int | None,
        typer.Option(
            "--output-len",
            help="Output tokens (default 128; for sharegpt: the reply's length).",
            rich_help_panel=WORKLOAD,
            show_default=False,
        ),
    ] = None,
    range_ratio: Annotated[
        float, typer.Option("--range-ratio", help="Lengths are drawn from len·[1-r, 1+r].", rich_help_panel=WORKLOAD)
    ] = 0.0,
    num_users: Annotated[
        int,
        typer.Option("--num-users", help="shared-prefix: users, each with a system prompt.", rich_help_panel=WORKLOAD),
    ] = 4,
    prefix_len: Annotated[
        int, typer.Option("--prefix-len", help="shared-prefix: system prompt tokens.", rich_help_panel=WORKLOAD)
    ] = 256,
    prompt_format: Annotated[
        str,
        typer.Option(
            "--prompt-format",
            help="auto | tokens | text (auto: token ids in process, text over HTTP).",
            rich_help_panel=WORKLOAD,
        ),
    ] = "auto",
    ignore_eos: Annotated[
        bool | None,
        typer.Option(
            "--ignore-eos/--no-ignore-eos",
            help="Generate every asked token (default: on for random and shared-prefix, off for sharegpt).",
            rich_help_panel=WORKLOAD,
            show_default=False,
        ),
    ] = None,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", help="Most requests in flight (0: no limit).", rich_help_panel=LOAD)
    ] = 64,
    request_rate: Annotated[
        float,
        typer.Option(
            "--request-rate", help="Poisson arrivals per second; inf sends all at once.", rich_help_panel=LOAD
        ),
    ] = math.inf,
    warmup: Annotated[
        int, typer.Option("--warmup", help="Requests run before the timed run, not counted.", rich_help_panel=LOAD)
    ] = 1,
    seed: Annotated[
        int, typer.Option("--seed", help="Seeds the workload, the arrivals and the engine.", rich_help_panel=LOAD)
    ] = 0,
    slo_ttft_ms: Annotated[
        float | None,
        typer.Option("--slo-ttft-ms", help="Goodput counts requests with TTFT at most this.", rich_help_panel=REPORT),
    ] = 500.0,
    slo_tpot_ms: Annotated[
        float | None,
        typer.Option(
            "--slo-tpot-ms",
            help="... and TPOT at most this (default 33.3: 30 tok/s per stream).",
            rich_help_panel=REPORT,
            show_default=False,
        ),
    ] = 1000 / 30,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the figures to this JSON file.", rich_help_panel=REPORT)
    ] = None,
    lora_modules: Annotated[
        list[str] | None,
        typer.Option(
            "--lora-modules",
            help="NAME=DIR of a PEFT LoRA adapter, once per adapter (in process): the requests spread "
            "round-robin over them.",
            rich_help_panel=WORKLOAD,
        ),
    ] = None,
    baseline: Annotated[
        str | None,
        typer.Option(
            "--baseline",
            help="hf: run the same workload through transformers static batching and compare.",
            rich_help_panel=REPORT,
        ),
    ] = None,
    *,
    engine_config: EngineConfig,
) -> None:
    """Load-test the engine or a server. Measures TTFT, TPOT, ITL, end-to-end latency, throughput
    and goodput under a synthetic or ShareGPT load, in process or against --url, optionally next to
    transformers static batching."""
    from llmctl.bench.session import BenchOptions, run_bench

    out, err = Console(), Console(stderr=True, soft_wrap=True)
    options = BenchOptions(
        model=model,
        url=url,
        served_model_name=served_model_name,
        api_key=api_key,
        dataset=dataset,
        dataset_path=dataset_path,
        num_prompts=num_prompts,
        input_len=input_len,
        output_len=output_len,
        range_ratio=range_ratio,
        num_users=num_users,
        prefix_len=prefix_len,
        prompt_format=prompt_format,
        ignore_eos=ignore_eos,
        concurrency=concurrency,
        request_rate=request_rate,
        warmup=warmup,
        seed=seed,
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        json_path=json_path,
        baseline=baseline,
        engine_config=replace(engine_config, seed=seed),
        lora_modules=tuple(lora_modules or ()),
        quantization_given=given_on_command_line(ctx, "quantization"),
        argv=list(sys.argv[1:]),
    )
    with exit_on_error(err):
        run_bench(options, out, err)
