"""``llmctl chat``: streaming multi-turn chat in the terminal."""

from __future__ import annotations

import typer


def register_commands(app: typer.Typer) -> None:
    """Filled in by the feature's implementation."""
