"""Qwen3-Coder / Qwen3.5 XML calls (vLLM's `qwen3_coder`): one block per call,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text, typed by the function's parameter schema (the request's tools, `bind`): strings as
written, integers, numbers and booleans parsed, objects, arrays and untyped values read as JSON when they are JSON.
Without a schema (or for a parameter it does not list) a value that reads as JSON is that value, else the text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.service.openai.tool_parsers.base import (
    ForcedCalls, Parsed, ParsedCall, ToolParser, lark_json, lark_literal, repeated, tagged_calls,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_NUMBERS = {"integer": r"/-?(0|[1-9][0-9]*)/", "number": r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"}


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, schemas: dict[str, Any] | None = None):
        self.schemas = schemas or {}

    def bind(self, schemas: dict[str, Any]) -> Qwen3CoderParser:
        return Qwen3CoderParser(schemas)

    def parse(self, text: str, final: bool) -> Parsed:
        return tagged_calls(text, final, OPEN, CLOSE, self._call)

    def _call(self, body: str) -> ParsedCall | None:
        match = _FUNCTION.match(body)
        if match is None:
            return None
        name, inner = match.group(1).strip(), match.group(2)
        if _PARAMETER.sub("", inner).strip():
            return None  # text between the parameters: not this format
        properties = _properties(self.schemas.get(name))
        arguments = {key.strip(): _typed(_strip_newlines(value), properties.get(key.strip()))
                     for key, value in _PARAMETER.findall(inner)}
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))

    def forced_grammar(self, forced: ForcedCalls) -> str:
        """Calls with the required parameters of each function, in the schema's order, values typed by it."""
        rules = [f"start: {repeated('block', chr(10), forced)}",
                 f"block: {lark_literal(OPEN + chr(10))} call {lark_literal(chr(10) + CLOSE)}",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(forced.functions)))]
        for i, (name, schema) in enumerate(forced.functions):
            properties, required = _named_parameters(schema, i)
            params = " ".join(f"param_{i}_{j}" for j in range(len(required)))
            rules.append(f"call_{i}: {lark_literal(f'<function={name}>' + chr(10))} {params} "
                         f"{lark_literal('</function>')}")
            for j, key in enumerate(required):
                rules.append(f"param_{i}_{j}: {lark_literal(f'<parameter={key}>' + chr(10))} value_{i}_{j} "
                             f"{lark_literal(chr(10) + '</parameter>' + chr(10))}")
                rules.append(f"value_{i}_{j}: {_value_rule(properties[key])}")
        return "\n".join(rules)


def _named_parameters(schema: Any, index: int) -> tuple[dict[str, Any], list[str]]:
    """A function's named parameters (its object schema's properties) and the required ones, in schema order."""
    schema = {} if schema is True else schema
    properties = schema.get("properties", {}) if isinstance(schema, dict) else None
    if not isinstance(schema, dict) or schema.get("type", "object") != "object" or not isinstance(properties, dict):
        raise InvalidRequestError(f"tools[{index}].function.parameters", "qwen3_coder calls take named parameters: "
                                  "the parameters must be an object schema with properties")
    required = schema.get("required", [])
    return properties, [k for k in properties if isinstance(required, list) and k in required]


def _properties(schema: Any) -> dict[str, Any]:
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return properties if isinstance(properties, dict) else {}


def _strip_newlines(value: str) -> str:
    """The value between its tags, without the one newline the format puts on each side."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return value
    if kind in ("integer", "number"):
        try:
            return int(value) if kind == "integer" else float(value)
        except ValueError:
            return value
    if kind == "boolean" and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:  # objects, arrays, untyped and unknown parameters: JSON when it reads as JSON
        return json.loads(value)
    except ValueError:
        return value


def _value_rule(schema: Any) -> str:
    """Lark for one parameter's raw value: literals of an enum, a number, a boolean, a one-line string, or JSON."""
    if not isinstance(schema, dict):
        return lark_json(schema)
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return " | ".join(lark_literal(v if isinstance(v, str) else json.dumps(v)) for v in schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        return r"/[^<\n]+/"  # a value the closing tag cannot appear in (forced calls keep to one line)
    if kind in _NUMBERS:
        return _NUMBERS[kind]
    if kind == "boolean":
        return '"true" | "false"'
    return lark_json(schema)
