"""``llmctl serve``: load a model, start the engine loop, and serve the OpenAI API with uvicorn.

SIGTERM (or Ctrl+C) drains: the listening socket closes, streams of engine stats end, requests
still arriving on open connections get 503, and the requests in flight run to completion. After
``--drain-timeout`` seconds (or a second Ctrl+C) the ones left are cancelled: each gets a 503 error
(a stream: an error event, then ``[DONE]``) and its blocks are freed. Then the engine stops.

Exit status, for a supervisor (systemd, Kubernetes): 0 when everything drained, 1 when the server
could not start, 3 when the drain was cut short (requests were cancelled), 4 when the engine loop
died (a fault in model execution): then ``/health`` answers 503 at once and the process exits
within seconds so that it is restarted, as vLLM does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import socket
import time
import typing
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from llmctl import envs
from llmctl.cli_options import SERVER, ModelArg, engine_options, exit_on_error, parse_template_kwargs, usage_error
from llmctl.config import EngineConfig

if TYPE_CHECKING:
    import uvicorn

    from llmctl.server.model_manager import ModelManager
    from llmctl.server.serving import ServerState

EXIT_DRAIN_CUT_SHORT = 3
EXIT_ENGINE_DIED = 4
CANCEL_GRACE_S = 5.0  # for cancelled streams to send their error event and close
POLL_S = 0.05
err = Console(stderr=True, soft_wrap=True)
EMBEDDINGS = "Embeddings and rerank"
MODELS = "Many models"
LORA = "LoRA adapters"
MODEL_HELP = typing.get_args(ModelArg)[1].help


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _check_port_free(host: str, port: int) -> None:
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            err.print(
                f"[bold red]error:[/] cannot listen on {host}:{port}: {exc.strerror or exc} "
                "(another server? --port 0 picks a free port)"
            )
            raise typer.Exit(1) from None


def _make_server(
    config: uvicorn.Config,
    *,
    state: ServerState,
    manager: ModelManager,
    drain_timeout: float,
    on_ready: Callable[[int], None],
) -> uvicorn.Server:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server with llmctl's drain: it tells the app when it starts draining, cuts
        the drain short after ``drain_timeout`` (or a second Ctrl+C) by failing the requests left,
        and shuts down by itself when the engine loop dies."""

        cancelled = 0
        engine_died = False

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            state.draining = True
            super().handle_exit(sig, frame)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started and self.servers:
                on_ready(self.servers[0].sockets[0].getsockname()[1])

        async def on_tick(self, counter: int) -> bool:
            error = manager.dead_error()
            if error is not None and not self.engine_died:
                self.engine_died = True
                state.draining = True
                self.should_exit = True
                err.print(
                    f"[bold red]llmctl serve: the engine loop failed ({error!r}); "
                    f"exiting with status {EXIT_ENGINE_DIED} so that a supervisor restarts it[/]"
                )
            return await super().on_tick(counter)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            for server in self.servers:  # new connections are refused at once, not after the drain
                server.close()
            await self._drain()
            await super().shutdown(sockets)

        async def _drain(self) -> None:
            deadline = time.monotonic() + (0.0 if self.engine_died else drain_timeout)
            while manager.live and not self.force_exit and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
            if not manager.live:
                return
            why = (
                "the engine loop failed"
                if self.engine_died
                else ("a second interrupt" if self.force_exit else f"--drain-timeout {drain_timeout:g}s")
            )
            self.cancelled = manager.cancel_all(f"the server shut down before this request finished ({why})")
            err.print(
                f"llmctl serve: drain cut short by {why}: cancelled {self.cancelled} "
                f"request{'s' if self.cancelled != 1 else ''} still running"
            )
            grace = time.monotonic() + CANCEL_GRACE_S
            while manager.live and time.monotonic() < grace:
                await asyncio.sleep(POLL_S)

    return DrainingServer(config)


@engine_options(helps={"seed": "Seed of the requests that bring none."})
def serve(
    model: Annotated[
        str | None,
        typer.Argument(
            metavar="MODEL",
            help=f"{MODEL_HELP} NAME=MODEL serves it as NAME. Several MODELs (or --config): each is loaded on "
            "its first request and unloaded after --keep-alive idle.",
            show_default=False,
        ),
    ] = None,
    more_models: Annotated[
        list[str] | None,
        typer.Argument(metavar="MODEL...", help="More models, served by name.", show_default=False),
    ] = None,
    config_file: Annotated[
        str | None,
        typer.Option(
            "--config",
            help="A YAML, JSON or TOML file of models to serve (name, model, per-model engine options such as "
            "dtype, kv_cache_memory, max_model_len, quantization, keep_alive; LoRA adapters as lora_modules "
            "with max_loras and max_lora_rank) and the default keep_alive.",
            rich_help_panel=MODELS,
        ),
    ] = None,
    keep_alive: Annotated[
        str | None,
        typer.Option(
            "--keep-alive",
            help="How long a model stays loaded after its last request: 5m, 30s, 0 (unload after each "
            "answer), -1 (never). Default: 5m with several models; one model stays loaded.",
            rich_help_panel=MODELS,
        ),
    ] = None,
    memory_budget: Annotated[
        str | None,
        typer.Option(
            "--memory-budget",
            help="Most bytes (weights + KV pools) the loaded models may hold, e.g. 8GiB; a model that does not "
            "fit evicts the least recently used idle ones.",
            rich_help_panel=MODELS,
        ),
    ] = None,
    host: Annotated[
        str, typer.Option("--host", help="Address to bind (127.0.0.1: this machine only).", rich_help_panel=SERVER)
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="Port to bind; 0 picks a free one.", rich_help_panel=SERVER)
    ] = 8000,
    ollama_port: Annotated[
        int | None,
        typer.Option(
            "--ollama-port",
            min=0,
            max=65535,
            help="Also listen on this port, the same API (11434: for tools that assume Ollama's port).",
            rich_help_panel=SERVER,
            show_default=False,
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar=envs.API_KEY_ENV,
            help="Require `Authorization: Bearer KEY` on /v1/*.",
            rich_help_panel=SERVER,
        ),
    ] = None,
    served_model_name: Annotated[
        str | None,
        typer.Option(
            "--served-model-name", help="Model name in the API (default: the MODEL argument).", rich_help_panel=SERVER
        ),
    ] = None,
    max_queue: Annotated[
        int,
        typer.Option(
            "--max-queue",
            min=0,
            help="Most requests waiting for the engine; beyond it: 503 with Retry-After.",
            rich_help_panel=SERVER,
        ),
    ] = 1024,
    drain_timeout: Annotated[
        float,
        typer.Option(
            "--drain-timeout",
            min=0,
            help="On SIGTERM, seconds to let in-flight requests finish.",
            rich_help_panel=SERVER,
        ),
    ] = 30.0,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.", rich_help_panel=SERVER)] = "info",
    access_log: Annotated[
        bool, typer.Option("--access-log/--no-access-log", help="Log every request.", rich_help_panel=SERVER)
    ] = True,
    default_chat_template_kwargs: Annotated[
        str | None,
        typer.Option(
            "--default-chat-template-kwargs",
            help="A JSON object of chat-template variables every chat request starts "
            "from, e.g. '{\"enable_thinking\": false}'; a request's chat_template_kwargs override them.",
            rich_help_panel=SERVER,
        ),
    ] = None,
    trust_request_chat_template: Annotated[
        bool,
        typer.Option(
            "--trust-request-chat-template",
            help="Let a request bring its own chat_template (Jinja that runs, "
            "sandboxed, in this server); without it such a request gets a 400.",
            rich_help_panel=SERVER,
        ),
    ] = False,
    reasoning_parser: Annotated[
        str | None,
        typer.Option(
            "--reasoning-parser",
            help="Split a thinking model's <think> block into reasoning_content: deepseek_r1 (output is "
            "reasoning until </think>), qwen3 (reasoning only from a <think>), gpt_oss (harmony's analysis "
            "channel), or auto (picked from the chat template and vocabulary; none for a model that does not think).",
            rich_help_panel=SERVER,
        ),
    ] = None,
    pooling: Annotated[
        str | None,
        typer.Option(
            "--pooling",
            help="/v1/embeddings pooling: last, mean or cls (default: the model's sentence-transformers "
            "modules.json, else last).",
            rich_help_panel=EMBEDDINGS,
        ),
    ] = None,
    normalize: Annotated[
        bool | None,
        typer.Option(
            "--normalize/--no-normalize",
            help="L2-normalize embeddings (default: the model's sentence-transformers modules, else on).",
            rich_help_panel=EMBEDDINGS,
        ),
    ] = None,
    matryoshka: Annotated[
        bool | None,
        typer.Option(
            "--matryoshka/--no-matryoshka",
            help="Accept `dimensions` (the model was trained Matryoshka-style; default: config.json's "
            "is_matryoshka / matryoshka_dimensions).",
            rich_help_panel=EMBEDDINGS,
        ),
    ] = None,
    rerank_template: Annotated[
        str | None,
        typer.Option(
            "--rerank-template",
            help="Score /v1/rerank and /score with the yes/no logits of this prompt ({query}, {document}, "
            "{instruction}; a file, or qwen3 for Qwen3-Reranker's); none: cosine similarity of embeddings "
            "(default: qwen3 for a model named Qwen3-Reranker, else none).",
            rich_help_panel=EMBEDDINGS,
        ),
    ] = None,
    rerank_tokens: Annotated[
        str,
        typer.Option("--rerank-tokens", help="The yes and no tokens of --rerank-template.", rich_help_panel=EMBEDDINGS),
    ] = "yes,no",
    lora_modules: Annotated[
        list[str] | None,
        typer.Option(
            "--lora-modules",
            help="LoRA adapters to serve: NAME=PATH (a PEFT adapter directory; several may follow one flag), "
            'or JSON {"name": ..., "path": ..., "base_model_name": ...} to pick the base model when serving '
            "several. A request names the adapter as its model.",
            rich_help_panel=LORA,
        ),
    ] = None,
    max_loras: Annotated[
        int,
        typer.Option(
            "--max-loras",
            min=1,
            help="Most LoRA adapters in a batch (device slots); a --config model's max_loras overrides it.",
            rich_help_panel=LORA,
        ),
    ] = EngineConfig.max_loras,
    max_lora_rank: Annotated[
        int,
        typer.Option(
            "--max-lora-rank",
            min=1,
            help="Largest LoRA rank an adapter may have; a --config model's max_lora_rank overrides it.",
            rich_help_panel=LORA,
        ),
    ] = EngineConfig.max_lora_rank,
    enable_lora_runtime_updates: Annotated[
        bool,
        typer.Option(
            "--enable-lora-runtime-updates",
            help="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter.",
            rich_help_panel=LORA,
        ),
    ] = False,
    *,
    engine_config: EngineConfig,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API. Completions, chat, streaming, embeddings, /metrics.

    With several MODELs (or --config) each is loaded on its first request, kept for --keep-alive,
    and unloaded; the request's `model` picks it. `llmctl ps` and `llmctl stop` manage them."""
    import uvicorn

    from llmctl.config import parse_size
    from llmctl.pooling_params import POOLING_TYPES
    from llmctl.reasoning import CHOICES
    from llmctl.server.app import build_app
    from llmctl.server.model_manager import (
        DEFAULT_KEEP_ALIVE_S,
        FOREVER,
        ModelManager,
        ServerOptions,
        check_adapter_names,
        describe_keep_alive,
        load_model,
        parse_keep_alive,
        read_config_file,
        spec_from_argument,
    )
    from llmctl.server.protocol import APIError
    from llmctl.server.serving import ChatTemplatePolicy, ServerState

    if reasoning_parser is not None and reasoning_parser not in CHOICES:
        err.print(f"[bold red]error:[/] --reasoning-parser {reasoning_parser}: choose from {', '.join(CHOICES)}")
        raise typer.Exit(1)
    if pooling is not None and pooling not in POOLING_TYPES:
        err.print(f"[bold red]error:[/] --pooling {pooling}: choose from {', '.join(POOLING_TYPES)}")
        raise typer.Exit(1)
    # `--lora-modules a=DIR b=DIR`: the names after the first land among the MODELs; an adapter
    # directory is never a model
    adapters = list(lora_modules or [])
    adapters += [m for m in more_models or [] if _is_adapter_argument(m)]
    more_models = [m for m in more_models or [] if not _is_adapter_argument(m)]
    specs = [spec_from_argument(m) for m in [model, *more_models] if m]
    settings: dict = {}
    with exit_on_error(err):
        if config_file is not None:
            from_file, settings = read_config_file(config_file)
            specs += from_file
    if not specs:
        usage_error("give a MODEL to serve (or several, or --config FILE)")
    if len({s.name for s in specs}) != len(specs):
        usage_error(f"two models share a name: {', '.join(s.name for s in specs)} (NAME=MODEL names one)")
    single = len(specs) == 1 and config_file is None
    if served_model_name is not None:
        if not single:
            usage_error("--served-model-name names the one model served; with several, use NAME=MODEL or --config")
        specs = [dataclasses.replace(specs[0], name=served_model_name)]
    with exit_on_error(err):
        specs = _attach_adapters(specs, adapters)
        check_adapter_names(specs)
    engine_config = dataclasses.replace(
        engine_config,
        enable_lora=enable_lora_runtime_updates,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
    )
    if not single and engine_config.world_size > 1:
        usage_error("--tensor-parallel-size / --pipeline-parallel-size serve one model; several cannot be split")
    try:
        given_keep_alive = keep_alive if keep_alive is not None else settings.get("keep_alive")
        default_keep_alive = (
            parse_keep_alive(given_keep_alive, "--keep-alive")
            if given_keep_alive is not None
            else (FOREVER if single else DEFAULT_KEEP_ALIVE_S)
        )
    except APIError as exc:
        usage_error(exc.message)
    with exit_on_error(err):
        budget_text = memory_budget if memory_budget is not None else settings.get("memory_budget")
        budget = parse_size(budget_text) if budget_text is not None else None
    _check_port_free(host, port)  # before loading the model, not after
    if ollama_port is not None:
        _check_port_free(host, ollama_port)
    with exit_on_error(err):
        chat_templates = ChatTemplatePolicy(
            trust_request_chat_template,
            parse_template_kwargs(default_chat_template_kwargs, "--default-chat-template-kwargs"),
        )
    options = ServerOptions(
        engine_config,
        max_queue,
        chat_templates,
        reasoning_parser,
        pooling=dict(
            pooling=pooling,
            normalize=normalize,
            matryoshka=matryoshka,
            rerank_template=rerank_template,
            rerank_tokens=rerank_tokens,
        ),
    )
    state = ServerState()

    def on_event(message: str) -> None:
        err.print(f"[dim]llmctl serve: {escape(message)}[/]", soft_wrap=True)

    manager = ModelManager(
        specs,
        lambda spec: load_model(spec, options, state),
        server_state=state,
        default_keep_alive_s=default_keep_alive,
        memory_budget=budget,
        pinned=single and given_keep_alive is None,
        base_config=engine_config,
        on_event=on_event,
    )
    label = ""
    if single:  # loaded now, as it always was: a bad model is exit status 1 before the port opens
        try:
            with exit_on_error(err):
                served = load_model(
                    specs[0], options, state, allow_pull=None, on_settings=lambda line: err.print(f"[dim]{line}[/]")
                )
        except (ValueError, OSError) as exc:
            err.print(f"[bold red]error:[/] {escape(str(exc))}")
            raise typer.Exit(1) from None
        err.print(f"[dim]{served.description}[/]", soft_wrap=True)
        manager.adopt(specs[0].name, served)
        label = f"{served.async_engine.engine.model_label} as {specs[0].name!r}"
    else:
        label = f"{len(specs)} models ({', '.join(s.name for s in specs)}), each loaded on its first request,"
        extra = f"keep-alive {describe_keep_alive(default_keep_alive)}" + (
            f", memory budget {budget / 2**20:.0f} MiB" if budget is not None else ""
        )
        err.print(f"[dim]llmctl serve: {extra}[/]")
    app = build_app(
        manager, api_key=api_key, max_queue=max_queue, enable_lora_runtime_updates=enable_lora_runtime_updates
    )

    def uvicorn_config(bind_port: int) -> uvicorn.Config:
        return uvicorn.Config(
            app,
            host=host,
            port=bind_port,
            log_level=log_level,
            access_log=access_log,
            timeout_graceful_shutdown=CANCEL_GRACE_S,
            lifespan="off",
        )

    config = uvicorn_config(port)
    # --ollama-port: a second listening socket for the same app and server (one drain, one engine)
    sockets = None if ollama_port is None else [config.bind_socket(), uvicorn_config(ollama_port).bind_socket()]

    def on_ready(bound_port: int) -> None:
        # plain print, one line: scripts (and the tests) read the URL from it
        print(
            f"llmctl serve: {label} at {_url(host, bound_port)}/v1 "
            f"(auth: {'API key' if api_key else 'none'}; SIGTERM drains)",
            flush=True,
        )
        if sockets is not None:
            print(f"llmctl serve: also at {_url(host, sockets[1].getsockname()[1])} (--ollama-port)", flush=True)

    server = _make_server(config, state=state, manager=manager, drain_timeout=drain_timeout, on_ready=on_ready)
    # uvicorn re-raises the signal that stopped it once it has drained; with these handlers in
    # place that is a no-op and the process exits 0 instead of dying of the signal
    quiet: dict[int, object] = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=sockets)
    finally:
        for sig, handler in quiet.items():
            signal.signal(sig, handler)
        manager.shutdown()
    if not server.started:
        raise typer.Exit(1)  # uvicorn logged why (address in use, ...)
    if server.engine_died:
        raise typer.Exit(EXIT_ENGINE_DIED)
    if server.cancelled:
        raise typer.Exit(EXIT_DRAIN_CUT_SHORT)
    err.print("[dim]llmctl serve: drained, bye[/]")


def _is_adapter_argument(argument: str) -> bool:
    """NAME=PATH where PATH is a PEFT adapter directory, or a JSON adapter entry."""
    from pathlib import Path

    from llmctl.lora.adapter import CONFIG_FILE

    if argument.lstrip().startswith("{"):
        return True
    name, sep, path = argument.partition("=")
    return bool(sep and name and path) and (Path(path).expanduser() / CONFIG_FILE).is_file()


def _attach_adapters(specs: list, adapters: list[str]) -> list:
    """The model specs with each ``--lora-modules`` adapter in its base model's ``lora_modules``."""
    import json

    from llmctl.errors import ConfigError

    by_name = {spec.name: dict(spec.adapters) for spec in specs}
    for entry in adapters:
        if entry.lstrip().startswith("{"):
            try:
                item = json.loads(entry)
                name, path, base = item["name"], item["path"], item.get("base_model_name")
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ConfigError(
                    f"--lora-modules {entry}: expected JSON with name, path and base_model_name"
                ) from None
        else:
            name, sep, path = entry.partition("=")
            base = None
            if not (sep and name and path):
                raise ConfigError(f"--lora-modules {entry!r}: expected NAME=PATH")
        if base is None:
            if len(specs) != 1:
                raise ConfigError(
                    f"--lora-modules {name}: several models are served; name its base model with "
                    '{"name": ..., "path": ..., "base_model_name": ...}'
                )
            base = specs[0].name
        if base not in by_name:
            raise ConfigError(f"--lora-modules {name}: no served model is named {base!r}")
        if name in by_name or any(name in a for a in by_name.values()):
            raise ConfigError(f"--lora-modules {name}: the name is already served (a model or another adapter)")
        by_name[base][name] = str(path)
    return [spec.with_adapters(by_name[spec.name]) if by_name[spec.name] else spec for spec in specs]


def register_commands(app: typer.Typer) -> None:
    app.command(name="serve")(serve)
