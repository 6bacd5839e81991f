"""Tool calling, the request side: tools into the chat template, ``tool_choice`` into a grammar.

Rendering follows ``transformers``: the OpenAI ``tools`` list is handed to the chat template as its
``tools`` variable, and an assistant message's ``tool_calls[].function.arguments`` (a JSON string in
the OpenAI API) is parsed into a mapping, which is what templates expect (as vLLM does).

``required`` and named ``tool_choice`` are enforced with the grammar engine, as vLLM does: the reply
is constrained to a JSON schema (the function's parameters, or a list of ``{"name", "parameters"}``).
The reply's calls are read by ``llmctl.structured.tool_calls``.
"""

from __future__ import annotations

import json
from typing import Any

from llmctl.errors import InvalidRequestError
from llmctl.structured.spec import StructuredOutputSpec

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def template_variables(tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Extra chat-template variables for ``Tokenizer.apply_chat_template(..., **extra)``."""
    return {"tools": tools} if tools else {}


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant ``tool_calls`` arguments as mappings (templates ``tojson`` them); everything else as is."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_call_for_template(c) for c in calls]}
        out.append(message)
    return out


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(
                f"tool_calls arguments of {function.get('name')!r} are not valid JSON: {exc}"
            ) from exc
    return {**call, "function": function}


def forced_tool(tools: list[dict[str, Any]], tool_choice: Any) -> dict[str, Any] | None:
    """The function a named ``tool_choice`` forces; None for "auto"/"none"/"required"."""
    if not isinstance(tool_choice, dict):
        return None
    name = (tool_choice.get("function") or {}).get("name")
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool["function"]
    raise InvalidRequestError(
        f"tool_choice names function {name!r}, which is not among the tools "
        f"({', '.join(tool_names(tools)) or 'none given'})"
    )


def tool_choice_spec(tools: list[dict[str, Any]], tool_choice: Any) -> StructuredOutputSpec | None:
    """The grammar a ``required`` or named ``tool_choice`` imposes on the reply; None otherwise."""
    function = forced_tool(tools, tool_choice)
    if function is not None:
        return StructuredOutputSpec.json_schema(function.get("parameters") or EMPTY_PARAMETERS)
    if tool_choice != "required":
        return None
    one_call = [
        {
            "type": "object",
            "properties": {
                "name": {"enum": [t["function"]["name"]]},
                "parameters": t["function"].get("parameters") or EMPTY_PARAMETERS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return StructuredOutputSpec.json_schema({"type": "array", "minItems": 1, "items": {"anyOf": one_call}})
