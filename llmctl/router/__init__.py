"""``llmctl router``: prefix-aware, health-checked routing over several OpenAI-compatible servers."""

from llmctl.router.cli import register_commands

__all__ = ["register_commands"]
