"""Registers this package's command on the main ``llmctl`` app (see llmctl/cli.py)."""

from __future__ import annotations

import typer


def register_commands(app: typer.Typer) -> None:
    """Filled in by the feature's implementation."""
