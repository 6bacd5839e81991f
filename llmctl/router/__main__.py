"""``python -m llmctl.router``: the router alone, without importing the engine (torch), so it
starts in a moment and fits a small container. Same flags as ``llmctl router``."""

import typer

from llmctl.router.cli import router

if __name__ == "__main__":
    typer.run(router)
