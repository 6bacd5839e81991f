"""What a request asks its output to match, in a hashable form: the compiled-grammar cache key.

One spec per request, whichever API field carried it (``response_format``, ``guided_json``,
``guided_regex``, ``guided_choice``, ``structured_outputs``, a forced tool call). The text is
canonical (a JSON schema is re-serialised with sorted keys), so equal constraints share one cache
entry however the client spelled them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from llmctl.errors import InvalidRequestError

SpecKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputSpec:
    """``kind`` and its canonical ``text``: a JSON schema (JSON text), ``""`` for any JSON object,
    a regular expression, a JSON list of choice strings, or a Lark/GBNF grammar."""

    kind: SpecKind
    text: str
    # (``<think>`` id, ``</think>`` id, the output's first state): the grammar starts after the
    # model's think block (``structured/gate.py``); None: from the first token
    reasoning_gate: tuple[int, int, str] | None = None

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str) -> StructuredOutputSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"JSON schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, sort_keys=True, ensure_ascii=False))

    @classmethod
    def json_object(cls) -> StructuredOutputSpec:
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputSpec:
        if not isinstance(pattern, str) or not pattern:
            raise InvalidRequestError("a regex constraint must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutputSpec:
        if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError("a choice constraint must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def grammar(cls, grammar: str) -> StructuredOutputSpec:
        if not isinstance(grammar, str) or not grammar.strip():
            raise InvalidRequestError("a grammar constraint must be a non-empty Lark or GBNF grammar")
        return cls("grammar", grammar)

    @property
    def choices(self) -> list[str]:
        return json.loads(self.text) if self.kind == "choice" else []

    def __str__(self) -> str:
        text = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        described = f"{self.kind}({text})" if text else self.kind
        return described if self.reasoning_gate is None else f"{described} after reasoning"
