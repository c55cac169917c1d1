"""Hermes / Qwen: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call, text around
them is content (Hermes 2 Pro, Qwen 2.5 / 3, and the templates written after them)."""

from __future__ import annotations

import json

from pagedserve.service.openai.tool_parsers.base import (
    ForcedCalls, Parsed, ParsedCall, ToolParser, call_from_object, held_back, json_call_rules, lark_literal, repeated,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> Parsed:
        content, calls, pos = [], [], 0
        while (start := text.find(OPEN, pos)) >= 0:
            content.append(text[pos:start])
            end = text.find(CLOSE, start)
            if end < 0:  # an open block: wait for it, or at the end read what is there (Qwen may stop unclosed)
                if not final:
                    return Parsed("".join(content), tuple(calls))
                call = _call(text[start + len(OPEN):])
                calls += [call] if call else []
                content += [] if call else [text[start:]]
                return Parsed("".join(content), tuple(calls))
            call = _call(text[start + len(OPEN):end])
            calls += [call] if call else []
            content += [] if call else [text[start:end + len(CLOSE)]]
            pos = end + len(CLOSE)
        tail = text[pos:]
        if not final:
            tail = tail[:len(tail) - held_back(tail, (OPEN,))]
        content.append(tail)
        return Parsed("".join(content), tuple(calls))

    def forced_grammar(self, forced: ForcedCalls) -> str:
        rules = [f"start: {repeated('block', chr(10), forced)}",
                 f"block: {lark_literal(OPEN + chr(10))} call {lark_literal(chr(10) + CLOSE)}"]
        return "\n".join(rules + json_call_rules(forced, "arguments"))


def _call(body: str) -> ParsedCall | None:
    try:
        return call_from_object(json.loads(body))
    except ValueError:
        return None
