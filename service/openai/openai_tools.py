"""Forced tool calls: OpenAI `tools` + `tool_choice` -> a JSON Schema constraint, and the constrained text -> `tool_calls`.

A named function (`tool_choice: {"type": "function", "function": {"name": ...}}`) constrains the text to that
function's parameter schema: the text is the call's `arguments`. `"required"` constrains it to
`{"name": <one of the tools>, "parameters": <that tool's arguments>}` (one call; several tools: an `anyOf` choosing
among them), from which the call is read back. `"auto"` needs a model-specific tool parser, which this server does
not configure, so it is refused rather than silently answered in plain text; `"none"` is plain text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.constraint import ConstraintKind
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.service.openai.openai_constraints import RequestedConstraint, build

_NO_PARAMETERS = {"type": "object", "properties": {}}
# The head of a "required" call's text, up to where its arguments start; the name is a JSON string.
_REQUIRED_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*')
_CLOSERS = "} \t\r\n"


@dataclass(frozen=True, slots=True)
class ToolChoice:
    named: str | None  # the forced function's name; None: "required" (the text names the function)


def tool_constraint(body: dict[str, Any]) -> tuple[RequestedConstraint, ToolChoice] | None:
    """None when no tool call is forced (no tools, or tool_choice "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice", "needs tools")
        return None
    schemas = _function_schemas(tools)
    if choice == "none":
        return None
    if choice is None or choice == "auto":  # no tool_choice with tools means "auto": name what the client sent
        raise InvalidRequestError("tool_choice" if choice else "tools", 'tool_choice "auto" (the default with tools) '
                                  'needs a tool-call parser for the model, which this server does not configure; set '
                                  'tool_choice to "required" or name a function')
    if choice == "required":
        variants = [_named_call(name, schema) for name, schema in schemas.items()]
        schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
        return build(ConstraintKind.JSON_SCHEMA, schema, "tools"), ToolChoice(None)
    name = _named(choice)
    if name not in schemas:
        raise InvalidRequestError("tool_choice.function.name", f"{name!r} is not one of the tools: "
                                  + ", ".join(schemas))
    index = list(schemas).index(name)
    return build(ConstraintKind.JSON_SCHEMA, schemas[name], f"tools[{index}].function.parameters"), ToolChoice(name)


def _function_schemas(tools: Any) -> dict[str, Any]:
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", "must be a list of {\"type\": \"function\", \"function\": {...}}")
    schemas: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f"tools[{i}]", "must be {\"type\": \"function\", \"function\": {...}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}].function.name", "must be a non-empty string")
        if name in schemas:
            raise InvalidRequestError(f"tools[{i}].function.name", f"{name!r} is named twice")
        parameters = function.get("parameters", _NO_PARAMETERS)
        if not isinstance(parameters, (dict, bool)):
            raise InvalidRequestError(f"tools[{i}].function.parameters", "must be a JSON Schema object")
        schemas[name] = parameters
    return schemas


def _named_call(name: str, parameters: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
            "required": ["name", "parameters"], "additionalProperties": False}


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str):
        raise InvalidRequestError("tool_choice", 'must be "none", "auto", "required" or '
                                  '{"type": "function", "function": {"name": ...}}')
    return function["name"]


@dataclass(slots=True)
class ToolCallText:
    """One choice's constrained text read as one tool call, as it grows: what of it can be sent yet."""

    choice: ToolChoice
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    sent_head: bool = False
    sent_arguments: int = 0

    def split(self, text: str, final: bool) -> tuple[str, str] | None:
        """(name, arguments) readable from text so far; while not final, a trailing run of closing braces and
        whitespace is held back (part of it may close the "required" wrapper, not the arguments)."""
        if self.choice.named is not None:
            return self.choice.named, text
        head = _REQUIRED_HEAD.match(text)
        if head is None:
            return None
        name, body = json.loads(f'"{head.group(1)}"'), text[head.end():]
        if not final:
            return name, body.rstrip(_CLOSERS)
        body = body.rstrip()
        return name, (body[:-1] if body.endswith("}") else body).rstrip()

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The `tool_calls` stream delta for what text adds: the call's id and name once, then argument pieces."""
        read = self.split(text, final)
        if read is None:
            return []
        name, arguments = read
        piece = arguments[self.sent_arguments:]
        self.sent_arguments = max(self.sent_arguments, len(arguments))
        if not self.sent_head:  # the call's first delta: its id and name, with the arguments so far
            self.sent_head = True
            return [{"index": 0, "id": self.id, "type": "function", "function": {"name": name, "arguments": piece}}]
        return [{"index": 0, "function": {"arguments": piece}}] if piece else []

    def whole(self, text: str) -> list[dict[str, Any]] | None:
        read = self.split(text, final=True)
        if read is None:
            return None
        return [{"id": self.id, "type": "function", "function": {"name": read[0], "arguments": read[1]}}]
