"""The API fields that ask for structured output, turned into one :class:`StructuredOutputSpec`.

OpenAI's ``response_format`` (``json_object``, ``json_schema``) and vLLM's extensions
(``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and the newer
``structured_outputs`` object) all land here; a request may use one of them, and a request that
uses two is refused rather than having one silently win.
"""

from __future__ import annotations

from typing import Any

from llmctl.errors import InvalidRequestError
from llmctl.structured.spec import StructuredOutputSpec

STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputSpec | None:
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec.json_object()
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, dict) or "schema" not in body:
            raise InvalidRequestError("response_format json_schema needs json_schema.schema (the JSON schema)")
        return StructuredOutputSpec.json_schema(body["schema"])
    raise InvalidRequestError(
        f"response_format type {kind!r} is not supported (use 'text', 'json_object' or 'json_schema')"
    )


def _from_structured_outputs(options: dict[str, Any]) -> StructuredOutputSpec | None:
    unknown = sorted(
        k
        for k, v in options.items()
        if v not in (None, False)
        and k not in STRUCTURED_OUTPUT_KEYS
        and not k.startswith("disable_")
        and k not in ("whitespace_pattern",)
    )
    if unknown:
        raise InvalidRequestError(
            f"structured_outputs {', '.join(unknown)} is not supported by llmctl "
            f"(supported: {', '.join(STRUCTURED_OUTPUT_KEYS)})"
        )
    given = {k: options[k] for k in STRUCTURED_OUTPUT_KEYS if options.get(k) not in (None, False)}
    if len(given) > 1:
        raise InvalidRequestError(f"structured_outputs takes one constraint, got {', '.join(given)}")
    if not given:
        return None
    key, value = next(iter(given.items()))
    return _make(key, value)


def _make(key: str, value: Any) -> StructuredOutputSpec:
    if key == "json":
        return StructuredOutputSpec.json_schema(value)
    if key == "json_object":
        return StructuredOutputSpec.json_object()
    if key == "regex":
        return StructuredOutputSpec.regex(value)
    if key == "choice":
        return StructuredOutputSpec.choice(value)
    return StructuredOutputSpec.grammar(value)


def spec_from_request(
    *,
    response_format: dict[str, Any] | None = None,
    guided_json: Any = None,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
    guided_grammar: str | None = None,
    structured_outputs: dict[str, Any] | None = None,
    tool_choice_spec: StructuredOutputSpec | None = None,
) -> StructuredOutputSpec | None:
    """The one constraint a request asks for, or None; ``InvalidRequestError`` if it asks for two or
    for something malformed."""
    candidates: dict[str, StructuredOutputSpec] = {}
    if response_format is not None and (spec := _from_response_format(response_format)) is not None:
        candidates["response_format"] = spec
    for name, key, value in (
        ("guided_json", "json", guided_json),
        ("guided_regex", "regex", guided_regex),
        ("guided_choice", "choice", guided_choice),
        ("guided_grammar", "grammar", guided_grammar),
    ):
        if value is not None:
            candidates[name] = _make(key, value)
    if structured_outputs is not None and (spec := _from_structured_outputs(structured_outputs)) is not None:
        candidates["structured_outputs"] = spec
    if tool_choice_spec is not None:
        candidates["tool_choice"] = tool_choice_spec
    if len(candidates) > 1:
        raise InvalidRequestError(f"a request can ask for one output constraint; got {', '.join(candidates)}")
    return next(iter(candidates.values()), None)
