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
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from llmctl import envs
from llmctl.cli_options import SERVER, ModelArg, config_for_model, engine_options, exit_on_error, parse_template_kwargs
from llmctl.config import EngineConfig

if TYPE_CHECKING:
    import uvicorn

    from llmctl.engine.async_engine import AsyncEngine
    from llmctl.server.serving import ServerState

EXIT_DRAIN_CUT_SHORT = 3
EXIT_ENGINE_DIED = 4
CANCEL_GRACE_S = 5.0  # for cancelled streams to send their error event and close
POLL_S = 0.05
err = Console(stderr=True, soft_wrap=True)


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
    async_engine: AsyncEngine,
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
            if async_engine.error is not None and not self.engine_died:
                self.engine_died = True
                state.draining = True
                self.should_exit = True
                err.print(
                    f"[bold red]llmctl serve: the engine loop failed ({async_engine.error!r}); "
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
            while state.live and not self.force_exit and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
            if not state.live:
                return
            why = (
                "the engine loop failed"
                if self.engine_died
                else ("a second interrupt" if self.force_exit else f"--drain-timeout {drain_timeout:g}s")
            )
            self.cancelled = state.cancel_all(f"the server shut down before this request finished ({why})")
            err.print(
                f"llmctl serve: drain cut short by {why}: cancelled {self.cancelled} "
                f"request{'s' if self.cancelled != 1 else ''} still running"
            )
            grace = time.monotonic() + CANCEL_GRACE_S
            while state.live and time.monotonic() < grace:
                await asyncio.sleep(POLL_S)

    return DrainingServer(config)


@engine_options(helps={"seed": "Seed of the requests that bring none."})
def serve(
    model: ModelArg,
    host: Annotated[
        str, typer.Option("--host", help="Address to bind (127.0.0.1: this machine only).", rich_help_panel=SERVER)
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="Port to bind; 0 picks a free one.", rich_help_panel=SERVER)
    ] = 8000,
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
    *,
    engine_config: EngineConfig,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API. Completions, chat, streaming, /metrics."""
    import uvicorn

    from llmctl.engine.async_engine import AsyncEngine
    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.server.app import build_app
    from llmctl.server.serving import ChatTemplatePolicy, ServerState

    _check_port_free(host, port)  # before loading the model, not after
    with exit_on_error(err):
        chat_templates = ChatTemplatePolicy(
            trust_request_chat_template,
            parse_template_kwargs(default_chat_template_kwargs, "--default-chat-template-kwargs"),
        )
        config = config_for_model(engine_config, model)
        loading = time.perf_counter()
        engine = LLMEngine(config)
    if engine.tokenizer is None:
        err.print("[bold red]error:[/] the server needs the model's tokenizer (tokenizer.json)")
        raise typer.Exit(1)
    err.print(
        f"[dim]model: {engine.model_label} · {engine.dtype_description} · {engine.kv_description} · "
        f"{engine.device} · "
        f"{engine.runner.decode_path} · "
        f"{engine.weights_description} · "
        f"{engine.block_manager.num_blocks} KV blocks of {config.block_size} · max_model_len "
        f"{engine.max_model_len} · load {time.perf_counter() - loading:.2f}s[/]",
        soft_wrap=True,
    )

    name = served_model_name or model
    state = ServerState()
    async_engine = AsyncEngine(engine, max_waiting=max_queue).start()
    app = build_app(
        async_engine,
        served_model_name=name,
        model_aliases={model, config.model},
        api_key=api_key,
        max_queue=max_queue,
        state=state,
        chat_templates=chat_templates,
    )

    def on_ready(bound_port: int) -> None:
        # plain print, one line: scripts (and the tests) read the URL from it
        print(
            f"llmctl serve: {engine.model_label} as {name!r} at {_url(host, bound_port)}/v1 "
            f"(auth: {'API key' if api_key else 'none'}; SIGTERM drains)",
            flush=True,
        )

    server = _make_server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=access_log,
            timeout_graceful_shutdown=CANCEL_GRACE_S,
            lifespan="off",
        ),
        state=state,
        async_engine=async_engine,
        drain_timeout=drain_timeout,
        on_ready=on_ready,
    )
    # uvicorn re-raises the signal that stopped it once it has drained; with these handlers in
    # place that is a no-op and the process exits 0 instead of dying of the signal
    quiet: dict[int, object] = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in quiet.items():
            signal.signal(sig, handler)
        async_engine.shutdown()
    if not server.started:
        raise typer.Exit(1)  # uvicorn logged why (address in use, ...)
    if server.engine_died:
        raise typer.Exit(EXIT_ENGINE_DIED)
    if server.cancelled:
        raise typer.Exit(EXIT_DRAIN_CUT_SHORT)
    err.print("[dim]llmctl serve: drained, bye[/]")


def register_commands(app: typer.Typer) -> None:
    app.command(name="serve")(serve)
