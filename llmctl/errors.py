"""Errors a user can act on. Each names what was wrong (the file, the parameter, the limit)."""

from __future__ import annotations


class LlmctlError(Exception):
    """Base class: the CLI prints these as one clear line instead of a traceback."""


class ModelLoadError(LlmctlError):
    """A model directory or file is missing, corrupt, or does not match its config."""


class ModelNotFoundError(ModelLoadError):
    """No local directory, cached hub snapshot or embedded model has this name."""


class UnsupportedModelError(ModelLoadError):
    """The architecture in config.json is not one llmctl implements."""


class InvalidRequestError(LlmctlError, ValueError):
    """A request the engine refuses before allocating anything (bad prompt or sampling parameters)."""


class ConfigError(LlmctlError, ValueError):
    """An engine setting that cannot work (bad size, unknown dtype or backend, pool too small)."""


class EngineBusyError(LlmctlError):
    """The waiting queue is at its limit; the request was not queued (retry later)."""


class HubError(LlmctlError):
    """The Hugging Face hub (or the endpoint in HF_ENDPOINT) refused or could not be reached."""
