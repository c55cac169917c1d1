"""The formats of forced calls when no `--tool-call-parser` names the model's own: vLLM's JSON list for
`tool_choice: "required"` (`[{"name": ..., "parameters": {...}}, ...]`), and a named function's bare arguments."""

from __future__ import annotations

import json

from pagedserve.service.openai.tool_parsers.base import (
    ForcedCalls, Parsed, ParsedCall, ToolParser, call_from_object, decode_json, skip_space,
)


class JsonListFormat(ToolParser):
    name = "json_list"

    def parse(self, text: str, final: bool) -> Parsed:
        """Each complete item is a call as soon as it closes; at the end, a list cut short (max_tokens) keeps its
        complete calls and gives the rest back as content."""
        pos = skip_space(text, 0)
        if not text.startswith("[", pos):
            return Parsed(text if final else "")
        calls, pos = [], pos + 1
        while (decoded := decode_json(text, pos)) is not None:
            call = call_from_object(decoded[0], ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            pos = skip_space(text, decoded[1])
            if not text.startswith(",", pos):
                break
            pos += 1
        closed = text.startswith("]", pos) and skip_space(text, pos + 1) == len(text)
        if not final or closed:
            return Parsed("", tuple(calls))
        return Parsed(text[pos:].strip() if calls else text, tuple(calls))

    def forced_grammar(self, forced: ForcedCalls) -> str:
        raise NotImplementedError("the JSON list is forced by its JSON Schema (json_list_schema)")


def json_list_schema(forced: ForcedCalls) -> dict:
    variants = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, schema in forced.functions]
    items = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema = {"type": "array", "items": items, "minItems": forced.min_calls}
    if forced.max_calls is not None:
        schema["maxItems"] = forced.max_calls
    return schema


class NamedCallFormat(ToolParser):
    """The whole text is the arguments of the one named function (vLLM's named tool_choice); they are sent as they
    grow, which is why this format's call is there before it is complete."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", (ParsedCall(self.function, text.strip() if final else text.lstrip()),))

    def forced_grammar(self, forced: ForcedCalls) -> str:
        raise NotImplementedError("a named call is forced by its parameters' JSON Schema")


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
