"""Pythonic calls (Llama 3.2 / 4 pythonic templates, ToolACE): the answer is a Python list of calls with keyword
arguments, `[get_weather(city="Paris"), now()]`, optionally between `<|python_start|>` and `<|python_end|>`.
Argument values are literals; JSON's true/false/null are read as True/False/None (forced calls write JSON values).
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.service.openai.tool_parsers.base import (
    ForcedCalls, Parsed, ParsedCall, ToolParser, lark_json, lark_literal, repeated,
)

START, END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}
_MAX_CHARS = 64 * 1024  # ast.parse of a longer answer is not attempted: it is content


class PythonicParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.strip()
        body = body.removeprefix(START).removesuffix(END).strip() if body.startswith(START) else body
        could_be_call = body.startswith("[") or (not final and (START.startswith(body) or body.startswith(START)))
        if not could_be_call:
            return Parsed(text)
        if not final:  # a list that looks whole may still go on: calls are read at the end only
            return Parsed("")
        calls = _calls(body) if body.endswith("]") and len(body) <= _MAX_CHARS else None
        return Parsed("", tuple(calls)) if calls is not None else Parsed(text)

    def forced_grammar(self, forced: ForcedCalls) -> str:
        """Calls with their required parameters, in schema order, each value a JSON value of its schema."""
        rules = [f"start: {lark_literal('[')} {repeated('call', ', ', forced)} {lark_literal(']')}",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(forced.functions)))]
        for i, (name, schema) in enumerate(forced.functions):
            properties, required = _keywords(schema, i)
            args = []
            for j, prop in enumerate(required):
                rules.append(f"arg_{i}_{j}: {lark_json(properties[prop])}")
                args.append(f"{lark_literal((', ' if j else '') + prop + '=')} arg_{i}_{j}")
            rules.append(f"call_{i}: {lark_literal(name + '(')} {' '.join(args)} {lark_literal(')')}")
        return "\n".join(rules)


def _keywords(schema: Any, index: int) -> tuple[dict[str, Any], list[str]]:
    """A function's keyword parameters (its object schema's properties) and the required ones, in schema order."""
    schema = {} if schema is True else schema
    properties = schema.get("properties", {}) if isinstance(schema, dict) else None
    if not isinstance(schema, dict) or schema.get("type", "object") != "object" or not isinstance(properties, dict) \
            or not all(isinstance(p, (dict, bool)) for p in properties.values()):
        raise InvalidRequestError(f"tools[{index}].function.parameters", "pythonic calls take keyword arguments: "
                                  "the parameters must be an object schema with properties")
    required = schema.get("required", [])
    return properties, [p for p in required if p in properties] if isinstance(required, list) else []


def _calls(body: str) -> list[ParsedCall] | None:
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not (name := _name(node.func)):
            return None
        try:
            arguments = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(arguments) != len(node.keywords):
            return None  # a **kwargs spread
        calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and (base := _name(func.value)):
        return f"{base}.{func.attr}"
    return None


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k) if k is not None else _fail(): _literal(v) for k, v in zip(node.keys, node.values)}
    value = ast.literal_eval(node)  # strings, numbers, True/False/None, and negative numbers
    if isinstance(value, (bytes, complex, set)):
        raise ValueError("not a JSON value")
    return value


def _fail() -> Any:
    raise ValueError("a ** spread in a dict literal")
