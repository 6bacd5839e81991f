"""llmctl: a terminal-first LLM inference engine."""

__version__ = "0.1.0"
