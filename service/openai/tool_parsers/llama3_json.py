"""Llama 3.1 / 3.2 / 3.3 JSON calls: the whole answer is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several calls separated by `;`. An answer that does not start so is plain content."""

from __future__ import annotations

from pagedserve.service.openai.tool_parsers.base import (
    ForcedCalls, Parsed, ParsedCall, ToolParser, call_from_object, decode_json, json_call_rules, repeated,
    skip_space,
)

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_space(text, start + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[start:]):
            return Parsed("")  # could still become the tag
        if start < len(text) and text[start] != "{" or (final and start >= len(text)):
            return Parsed(text)
        calls, pos = _calls(text, start)
        if final and (not calls or skip_space(text, pos) < len(text)):
            rest = text[pos:]
            return Parsed(text if not calls else rest.lstrip().removeprefix(SEPARATOR).lstrip(), tuple(calls))
        return Parsed("", tuple(calls))

    def forced_grammar(self, forced: ForcedCalls) -> str:
        rules = [f"start: {repeated('call', SEPARATOR + ' ', forced)}"]
        return "\n".join(rules + json_call_rules(forced, "parameters"))


def _calls(text: str, pos: int) -> tuple[list[ParsedCall], int]:
    """The complete calls from pos on, and where the first incomplete or unreadable piece starts."""
    calls: list[ParsedCall] = []
    while True:
        decoded = decode_json(text, pos)
        call = call_from_object(decoded[0]) if decoded else None
        if call is None:
            return calls, pos
        calls.append(call)
        pos = decoded[1]
        after = skip_space(text, pos)
        if not text.startswith(SEPARATOR, after):
            return calls, pos
        pos = after + len(SEPARATOR)
