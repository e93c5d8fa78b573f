"""Tool calls that need no model-specific parser: with `tool_choice` "required" or a named
function, the reply is constrained (structured output) to JSON that is the call itself, as vLLM
does. Named: the function's arguments, by its parameters schema. Required: a non-empty array of
{"name", "parameters"} objects, each naming one of the tools with arguments for its schema.
`tool_choice` "auto" needs a parser per model family to find calls in free text: not yet."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from minivllm.entrypoints.openai.protocol import random_id
from minivllm.entrypoints.openai.serving import OpenAIError

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    """What a chat request's tools ask for: one named function, or "required" (name None)."""

    name: str | None

    @property
    def finish_reason_when_called(self) -> str | None:
        """vLLM's rule: a forced named call keeps the reply's finish reason; calls the model
        chose under "required" finish with "tool_calls"."""
        return None if self.name else "tool_calls"


def parse_tool_choice(tools: list[dict[str, Any]] | None, tool_choice: Any) -> tuple[ToolChoice | None, dict | None]:
    """The tool choice and the JSON schema the reply must follow (None, None: no tool call
    forced, the tools are ignored); an OpenAIError (400) for what cannot be served."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise OpenAIError("tool_choice needs tools to choose from.", 400, "tool_choice")
        return None, None
    if tool_choice == "none":
        return None, None
    functions = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict) or not function.get("name"):
            raise OpenAIError("Each tool needs type 'function' and a function with a name.", 400, "tools")
        functions[function["name"]] = function.get("parameters") or _EMPTY_PARAMETERS
    if tool_choice is None or tool_choice == "auto":
        raise OpenAIError('tool_choice "auto" needs a tool parser for the model, which minivllm does not have yet; '
                          'use tool_choice "required" or a named function.', 400, "tool_choice")
    if tool_choice == "required":
        return ToolChoice(None), {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
             "required": ["name", "parameters"]}
            for name, parameters in functions.items()]}}
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if name not in functions:
        raise OpenAIError(f"tool_choice names {name!r}, which is not among the tools.", 400, "tool_choice")
    return ToolChoice(name), functions[name]


def tool_calls(choice: ToolChoice, text: str) -> list[dict[str, Any]]:
    """The calls in a complete reply (none if it was cut short and does not parse)."""
    if choice.name is not None:
        return [_call(choice.name, text)]
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return []
    return [_call(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in calls]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": random_id("call"), "type": "function", "function": {"name": name, "arguments": arguments}}
