"""``llmctl ps`` and ``llmctl stop``: the models of a running ``llmctl serve``.

``ps`` reads ``GET /v1/models/status`` and draws one row per model the server can serve: whether it
is loaded, its memory (weights + KV pool), requests in flight, how long it has been idle and how
long it stays loaded (``llmctl top`` draws the same table for a server of several models). ``stop``
asks ``POST /v1/models/unload`` to unload a model now; a model with
requests in flight is refused (409) unless ``--force`` cancels them. Neither imports torch.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmctl import envs

DEFAULT_URL = "http://127.0.0.1:8000"
TIMEOUT_S = 30.0
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

Url = Annotated[str, typer.Option("--url", help="Base URL of a running `llmctl serve`.")]
ApiKey = Annotated[
    str | None,
    typer.Option("--api-key", envvar=envs.API_KEY_ENV, help="Bearer token, if the server wants one."),
]


def _request(method: str, url: str, api_key: str | None, path: str, body: dict[str, Any] | None = None) -> Any:
    """The JSON answer; a server that cannot be reached or answers an error is one red line, exit 1."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.request(method, url.rstrip("/") + path, json=body, headers=headers, timeout=TIMEOUT_S)
    except httpx.HTTPError as exc:
        err.print(f"[bold red]error:[/] cannot reach {escape(url)}: {escape(str(exc) or type(exc).__name__)}")
        raise typer.Exit(1) from None
    try:
        data = response.json()
    except ValueError:
        data = None
    if response.status_code >= 400:
        message = data.get("error", {}).get("message") if isinstance(data, dict) else None
        err.print(f"[bold red]error:[/] {response.status_code}: {escape(message or response.text[:200])}")
        raise typer.Exit(1)
    return data


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _seconds(s: float | None, none: str = "-") -> str:
    if s is None:
        return none
    if s >= 3600:
        return f"{s / 3600:.1f}h"
    if s >= 60:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{s:.1f}s"


def status_table(status: dict[str, Any]) -> Table:
    table = Table(box=None, header_style="bold")
    for column in ("NAME", "STATUS", "MEMORY", "IN FLIGHT", "IDLE", "UNLOADS IN", "LOADS", "LAST LOAD"):
        table.add_column(column, justify="right" if column not in ("NAME", "STATUS") else "left")
    for m in status["models"]:
        if m["loaded"]:
            if m["in_flight"]:
                left = "busy"
            elif m["expires_in_s"] is not None:
                left = _seconds(m["expires_in_s"])
            else:
                left = "never"
        else:
            left = "-"
        state = m["status"] if not m.get("last_error") or m["loaded"] else "failed"
        table.add_row(
            escape(m["name"]),
            state,
            _size(m["size_bytes"]) if m["loaded"] else "-",
            str(m["in_flight"]),
            _seconds(m["idle_s"]),
            left,
            str(m["loads"]),
            _seconds(m["last_load_s"]),
        )
    return table


def memory_line(status: dict[str, Any]) -> str:
    """What the loaded models take, and of what budget."""
    budget = status.get("memory_budget_bytes")
    return f"{_size(status.get('memory_used_bytes'))} loaded" + (f" of a {_size(budget)} budget" if budget else "")


def ps(
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    all_models: Annotated[
        bool, typer.Option("--all", "-a", help="Also the models the server can serve that are not loaded.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="The server's answer as JSON.")] = False,
) -> None:
    """The models a running `llmctl serve` has loaded: memory, requests in flight, idle time, keep-alive left."""
    status = _request("GET", url, api_key, "/v1/models/status")
    if as_json:
        print(json.dumps(status, indent=2))
        return
    if not all_models:
        status = {**status, "models": [m for m in status["models"] if m["loaded"] or m["status"] == "loading"]}
    out.print(status_table(status))
    out.print(f"[dim]{memory_line(status)}[/]")
    for m in status["models"]:
        if m.get("last_error") and not m["loaded"]:
            out.print(f"[red]{escape(m['name'])}: {escape(m['last_error'])}[/]")


def stop(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="The model's name on the server.")],
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    force: Annotated[
        bool, typer.Option("--force", help="Cancel its requests in flight (otherwise a busy model is refused).")
    ] = False,
) -> None:
    """Unload MODEL from a running `llmctl serve` now (its next request loads it again)."""
    answer = _request("POST", url, api_key, "/v1/models/unload", {"model": model, "force": force})
    if not answer.get("unloaded"):
        out.print(f"{escape(answer['model'])} was not loaded")
        return
    aborted = answer.get("aborted", 0)
    suffix = f" (cancelled {aborted} request{'s' if aborted != 1 else ''})" if aborted else ""
    out.print(f"stopped {escape(answer['model'])}{suffix}")


def register_commands(app: typer.Typer) -> None:
    app.command(name="ps")(ps)
    app.command(name="stop")(stop)
