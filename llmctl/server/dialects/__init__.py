"""The other APIs clients speak, each a translation onto the OpenAI chat (or completions) path of
``serving.py``, which renders, generates and streams for all of them:

- ``anthropic``: Anthropic's Messages API, ``POST /v1/messages`` and ``/v1/messages/count_tokens``;
- ``ollama``: the Ollama API under ``/api`` (chat, generate, tags, show, ps, version);
- ``responses``: OpenAI's Responses API, ``POST /v1/responses``, without server-side state.

``bridge`` runs a translated request through that path and reads its answer back. Errors leave
in each API's own shape: :func:`error_body` picks it by path, for every error the app answers.
"""

from __future__ import annotations

from typing import Any

from llmctl.server.dialects import anthropic, ollama
from llmctl.server.protocol import APIError


def error_body(path: str, exc: APIError) -> dict[str, Any]:
    """``exc`` as the API under ``path`` answers errors (OpenAI's JSON for every other path)."""
    if anthropic.owns(path):
        return anthropic.error_body(exc)
    if ollama.owns(path):
        return ollama.error_body(exc)
    return exc.body()
