"""``llmctl top``: watch an engine live, over HTTP (``llmctl serve``), in-process (``--local``), or
from recorded snapshots (``--replay``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from llmctl.cli_options import config_for_model, engine_options, exit_on_error
from llmctl.config import EMBEDDED_MODEL_NAME, EngineConfig

LOCAL = "Local engine (--local)"
LOCAL_DEFAULTS = {"kv_cache_memory": "48MiB", "max_num_seqs": 48, "max_num_batched_tokens": 1024}  # a small pool fills visibly
err = Console(stderr=True, soft_wrap=True)


def run_app(app) -> None:
    """Run the dashboard in the terminal (tests replace this to drive it headless)."""
    app.run()


def register_commands(app: typer.Typer) -> None:
    @app.command()
    @engine_options(panel=LOCAL, defaults=LOCAL_DEFAULTS, helps={
        "kv_cache_memory": "KV pool of the --local engine (small, so the block map shows it fill)."})
    def top(
        url: Annotated[str, typer.Option("--url", help="Base URL of a running `llmctl serve`.")] = "http://127.0.0.1:8000",
        api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="LLMCTL_API_KEY",
                                                       help="Bearer token, if the server wants one.")] = None,
        interval: Annotated[float, typer.Option("--interval", min=0.05, help="Seconds between refreshes.")] = 0.25,
        replay: Annotated[Optional[Path], typer.Option("--replay", exists=True, dir_okay=False,
                                                       help="Play recorded snapshots (JSON lines) instead.")] = None,
        local: Annotated[bool, typer.Option("--local", help="Run an engine in-process under a synthetic load "
                                                           "and watch it (nothing else needs to run).")] = False,
        model: Annotated[str, typer.Option("--model", help="Model of the --local engine.", rich_help_panel=LOCAL)]
        = EMBEDDED_MODEL_NAME,
        rate: Annotated[float, typer.Option("--rate", min=0.01, help="Synthetic arrivals per second.",
                                            rich_help_panel=LOCAL)] = 3.0,
        *,
        engine_config: EngineConfig,
    ) -> None:
        """Watch an engine live. KV block map, batch composition, throughput, requests (q quits,
        ? helps). The engine options apply to --local."""
        from llmctl.tui.app import TopApp
        from llmctl.tui.sources import HttpSource, ReplaySource

        if local and replay is not None:
            raise typer.BadParameter("choose one of --local and --replay")
        with exit_on_error(err):
            if local:
                source = _local_source(model, rate, engine_config)
            elif replay is not None:
                source = ReplaySource.from_jsonl(replay, loop=True)
            else:
                source = HttpSource(url, api_key=api_key)
        run_app(TopApp(source, interval))


def _local_source(model: str, rate: float, engine_config: EngineConfig):
    """The engine is built here, before the screen takes over, so a bad option is one red line."""
    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.tui.load import LoadProfile
    from llmctl.tui.local import LocalSource

    config = config_for_model(engine_config, model)
    err.print(f"[dim]loading {model} for the local engine…[/]")
    engine = LLMEngine(config)
    return LocalSource(engine, LoadProfile(rate=rate, max_in_flight=max(8, 2 * config.max_num_seqs), seed=config.seed))
