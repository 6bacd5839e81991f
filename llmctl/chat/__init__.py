"""``llmctl chat``: streaming multi-turn chat in the terminal.

``session`` holds the conversation and builds prompts (no I/O), ``repl`` is the terminal loop,
``cli`` the command and its options.
"""

from llmctl.chat.cli import register_commands

__all__ = ["register_commands"]
