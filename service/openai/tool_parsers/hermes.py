"""Hermes / Qwen: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call, text around
them is content (Hermes 2 Pro, Qwen 2.5 / 3, and the templates written after them)."""

from __future__ import annotations

import json

from pagedserve.service.openai.tool_parsers.base import (
    ForcedCalls, Parsed, ParsedCall, ToolParser, call_from_object, json_call_rules, lark_literal, repeated,
    tagged_calls,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> Parsed:
        return tagged_calls(text, final, OPEN, CLOSE, _call)

    def forced_grammar(self, forced: ForcedCalls) -> str:
        rules = [f"start: {repeated('block', chr(10), forced)}",
                 f"block: {lark_literal(OPEN + chr(10))} call {lark_literal(chr(10) + CLOSE)}"]
        return "\n".join(rules + json_call_rules(forced, "arguments"))


def _call(body: str) -> ParsedCall | None:
    try:
        return call_from_object(json.loads(body))
    except ValueError:
        return None
