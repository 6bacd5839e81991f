"""``llmctl top``: watch an engine live, over HTTP (``llmctl serve``), in-process (``--local``), or
from recorded snapshots (``--replay``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from llmctl import envs
from llmctl.cli_options import (
    BATCHING,
    KV,
    MODEL,
    QUANTIZATION,
    SAMPLING,
    SPECULATIVE,
    RemoteMode,
    config_for_model,
    engine_options,
    exit_on_error,
    given_on_command_line,
    usage_error,
)
from llmctl.config import EMBEDDED_MODEL_NAME, EngineConfig

SOURCE = "Source"
LOCAL = "Local engine (--local)"
LOCAL_NOTE = " (--local)"
# a small pool, so that the block map shows it fill
LOCAL_DEFAULTS = {"kv_cache_memory": "48MiB", "max_num_seqs": 48, "max_num_batched_tokens": 1024}
err = Console(stderr=True, soft_wrap=True)


def run_app(app) -> None:
    """Run the dashboard in the terminal (tests replace this to drive it headless)."""
    app.run()


def register_commands(app: typer.Typer) -> None:
    app.command(name="top")(top)


def _watches_elsewhere(params: Mapping[str, Any]) -> bool:
    return not params["local"]


@engine_options(
    groups=(MODEL, BATCHING, KV, QUANTIZATION, SPECULATIVE, SAMPLING),
    exclude=("chat_template",),
    defaults=LOCAL_DEFAULTS,
    panel_note=LOCAL_NOTE,
    helps={
        "kv_cache_memory": "KV pool of the --local engine (small, so the block map shows it fill).",
        "seed": "Seeds the --local engine and its synthetic load.",
    },
    remote=RemoteMode(_watches_elsewhere, "{flag} applies to top --local only (without it top runs no engine)"),
)
def top(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Argument(
            metavar="MODEL",
            help=f"With --local: the model to run (default {EMBEDDED_MODEL_NAME!r}, random weights, no download).",
            show_default=False,
        ),
    ] = None,
    url: Annotated[
        str, typer.Option("--url", help="Base URL of a running `llmctl serve`.", rich_help_panel=SOURCE)
    ] = "http://127.0.0.1:8000",
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key", envvar=envs.API_KEY_ENV, help="Bearer token, if the server wants one.", rich_help_panel=SOURCE
        ),
    ] = None,
    replay: Annotated[
        Path | None,
        typer.Option(
            "--replay",
            exists=True,
            dir_okay=False,
            help="Play recorded snapshots (JSON lines) instead.",
            rich_help_panel=SOURCE,
        ),
    ] = None,
    local: Annotated[
        bool,
        typer.Option(
            "--local",
            help="Run MODEL in-process under a synthetic load and watch it (nothing else needs to run).",
            rich_help_panel=SOURCE,
        ),
    ] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.05, help="Seconds between refreshes.")] = 0.25,
    rate: Annotated[
        float, typer.Option("--rate", min=0.01, help="Synthetic arrivals per second.", rich_help_panel=LOCAL)
    ] = 3.0,
    model_option: Annotated[str | None, typer.Option("--model", hidden=True)] = None,  # older than MODEL
    *,
    engine_config: EngineConfig,
) -> None:
    """Watch an engine live. KV block map, batch composition, throughput, requests (q quits,
    ? helps). By default a running `llmctl serve` at --url; --local MODEL runs one in-process (the
    engine options apply to it); --replay plays recorded snapshots."""
    from llmctl.tui.app import TopApp
    from llmctl.tui.sources import HttpSource, ReplaySource

    _check_source_flags(ctx, local=local, replay=replay is not None)
    if model_option is not None:
        if model is not None:
            usage_error("--model is the older spelling of MODEL: give one of them")
        model = model_option
    with exit_on_error(err):
        if local:
            source = _local_source(model or EMBEDDED_MODEL_NAME, rate, engine_config)
        elif replay is not None:
            source = ReplaySource.from_jsonl(replay, loop=True)
        else:
            source = HttpSource(url, api_key=api_key)
    run_app(TopApp(source, interval))


def _check_source_flags(ctx: typer.Context, *, local: bool, replay: bool) -> None:
    """Each flag belongs to one source: the server at --url, --local or --replay."""
    given = {name for name in ("model", "model_option", "url", "api_key", "rate") if given_on_command_line(ctx, name)}
    if local and replay:
        usage_error("--local and --replay: choose one source")
    for name, flag in (("model", "MODEL"), ("model_option", "--model"), ("rate", "--rate")):
        if name in given and not local:
            usage_error(f"{flag} applies to top --local only (without it top runs no engine)")
    for name, flag in (("url", "--url"), ("api_key", "--api-key")):
        if name in given and (local or replay):
            usage_error(f"{flag} and {'--local' if local else '--replay'}: {flag} is for watching a server")


def _local_source(model: str, rate: float, engine_config: EngineConfig):
    """The engine is built here, before the screen takes over, so a bad option is one red line."""
    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.tui.load import LoadProfile
    from llmctl.tui.local import LocalSource

    config = config_for_model(engine_config, model)
    err.print(f"[dim]loading {model} for the local engine…[/]")
    engine = LLMEngine(config)
    return LocalSource(engine, LoadProfile(rate=rate, max_in_flight=max(8, 2 * config.max_num_seqs), seed=config.seed))
