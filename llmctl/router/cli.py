"""``llmctl router``: an OpenAI-compatible front over several llmctl (or vLLM) servers."""

from __future__ import annotations

import logging
import signal
from typing import Annotated

import typer
from rich.console import Console

from llmctl import envs
from llmctl.router.policy import DEFAULT_LOAD_FACTOR, make_policy
from llmctl.router.prefix import DEFAULT_CHUNK_BYTES, DEFAULT_RING_CHUNKS
from llmctl.router.replicas import parse_discovery

err = Console(stderr=True, soft_wrap=True)
ROUTING = "Routing"


def _replica_urls(flags: list[str] | None) -> list[str]:
    """``--replica`` flags, or ``LLMCTL_ROUTER_REPLICAS`` (comma- or space-separated)."""
    urls = list(flags or []) or envs.LLMCTL_ROUTER_REPLICAS
    for url in urls:
        if not url.startswith(("http://", "https://")):
            err.print(f"[bold red]error:[/] --replica wants a URL like http://10.0.0.7:8000, got {url!r}")
            raise typer.Exit(1)
    return urls


def router(
    replica: Annotated[
        list[str] | None,
        typer.Option(
            "--replica",
            help="A server's base URL, e.g. http://127.0.0.1:8001 (repeatable; env "
            "LLMCTL_ROUTER_REPLICAS, comma-separated).",
            show_default=False,
        ),
    ] = None,
    discover: Annotated[
        str | None,
        typer.Option(
            "--discover",
            envvar=envs.ROUTER_DISCOVER_ENV,
            help="NAME:PORT of a Kubernetes headless Service: one replica per address its DNS returns.",
        ),
    ] = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to bind; 0 picks a free one.")] = 8080,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar=envs.API_KEY_ENV,
            help="Require `Authorization: Bearer KEY` on /v1/* (the header is passed on to the replicas).",
        ),
    ] = None,
    policy: Annotated[
        str,
        typer.Option(
            "--policy",
            help="prefix (prefix-aware consistent hashing with bounded load) | round-robin.",
            rich_help_panel=ROUTING,
        ),
    ] = "prefix",
    load_factor: Annotated[
        float,
        typer.Option(
            "--load-factor",
            help="A replica takes a request while it carries under this times the mean load.",
            rich_help_panel=ROUTING,
        ),
    ] = DEFAULT_LOAD_FACTOR,
    chunk_bytes: Annotated[
        int,
        typer.Option(
            "--chunk-bytes",
            min=1,
            help="Bytes of prompt per hashed chunk (64 ~ one 16-token KV block).",
            rich_help_panel=ROUTING,
        ),
    ] = DEFAULT_CHUNK_BYTES,
    ring_chunks: Annotated[
        int,
        typer.Option(
            "--ring-chunks",
            min=1,
            help="Leading chunks that place a new prefix on the hash ring.",
            rich_help_panel=ROUTING,
        ),
    ] = DEFAULT_RING_CHUNKS,
    max_attempts: Annotated[
        int,
        typer.Option(
            "--max-attempts", min=1, help="Replicas tried per request before it fails.", rich_help_panel=ROUTING
        ),
    ] = 3,
    health_interval: Annotated[
        float, typer.Option("--health-interval", min=0.05, help="Seconds between /health checks of a healthy replica.")
    ] = 2.0,
    max_backoff: Annotated[
        float,
        typer.Option(
            "--max-backoff",
            min=0.05,
            help="Longest wait between checks of a failing replica (doubling from --health-interval).",
        ),
    ] = 30.0,
    discovery_interval: Annotated[
        float, typer.Option("--discovery-interval", min=0.1, help="Seconds between DNS lookups with --discover.")
    ] = 10.0,
    log_level: Annotated[str, typer.Option("--log-level", help="Log level.")] = "info",
) -> None:
    """Route OpenAI requests over several servers: prefix-aware, health-checked, streaming through."""
    from llmctl.router.app import RouterSettings, build_router_app

    urls = _replica_urls(replica)
    if not urls and not discover:
        err.print("[bold red]error:[/] give the replicas: --replica URL (repeatable) or --discover NAME:PORT")
        raise typer.Exit(1)
    try:
        if discover:
            parse_discovery(discover)
        chosen_policy = make_policy(policy, load_factor=load_factor)
    except ValueError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(1) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request and probe
    settings = RouterSettings(
        api_key=api_key, chunk_bytes=chunk_bytes, ring_chunks=ring_chunks, max_attempts=max_attempts
    )
    app = build_router_app(
        urls,
        chosen_policy,
        settings,
        discover=discover,
        health_interval=health_interval,
        max_backoff=max_backoff,
        discovery_interval=discovery_interval,
    )
    source = f"DNS {discover}" if discover else f"{len(urls)} replicas"
    if not _serve(app, host, port, log_level, banner=f"llmctl router: {chosen_policy.name} over {source}"):
        raise typer.Exit(1)  # uvicorn logged why (address in use, ...)


def _serve(app: object, host: str, port: int, log_level: str, *, banner: str) -> bool:
    """Run uvicorn until SIGTERM (it drains open requests); False when it could not start. Prints
    one plain line with the bound URL once listening: scripts and tests read it."""
    import uvicorn

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets: list | None = None) -> None:
            await super().startup(sockets)
            if self.started and self.servers:
                bound = self.servers[0].sockets[0].getsockname()[1]
                shown = f"[{host}]" if ":" in host else host
                print(f"{banner} at http://{shown}:{bound}/v1", flush=True)

    server = AnnouncingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False))
    # uvicorn re-raises the signal that stopped it once it has drained; with these no-op handlers in
    # place that does nothing and the process exits 0 instead of dying of the signal
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return server.started


def register_commands(app: typer.Typer) -> None:
    app.command(name="router")(router)
