"""Mistral: content, then `[TOOL_CALLS]` and the calls: a JSON list `[{"name": ..., "arguments": {...}}, ...]`
(v3 tokenizers: Mistral 7B v0.3, Nemo) or `name[ARGS]{...}` after each marker (v11+: Small 3.2, Magistral).
Call ids are 9 letters and digits: Mistral's templates refuse others."""

from __future__ import annotations

import random
import string

from pagedserve.service.openai.tool_parsers.base import (
    ForcedCalls, Parsed, ParsedCall, ToolParser, arguments_text, call_from_object, decode_json, held_back,
    json_call_rules, lark_literal, repeated, skip_space,
)

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(MARKER)
        if start < 0:
            return Parsed(text if final else text[:len(text) - held_back(text, (MARKER,))])
        body = skip_space(text, start + len(MARKER))
        calls, end = _json_list(text, body) if text.startswith("[", body) else _v11_calls(text, start)
        if not final:
            return Parsed(text[:start], tuple(calls))
        if not calls:
            return Parsed(text)  # truncated or malformed: the whole answer is content
        return Parsed(text[:start] + text[end:].strip(), tuple(calls))

    def forced_grammar(self, forced: ForcedCalls) -> str:
        rules = [f"start: {lark_literal(MARKER + '[')} {repeated('call', ', ', forced)} {lark_literal(']')}"]
        return "\n".join(rules + json_call_rules(forced, "arguments"))

    def call_id(self, index: int, random_hex: str) -> str:
        return "".join(random.Random(random_hex).choices(_ID_CHARS, k=9))


def _json_list(text: str, pos: int) -> tuple[list[ParsedCall], int]:
    """The list's calls once the whole list is there and every item is a call; else none, read from pos."""
    decoded = decode_json(text, pos)
    if decoded is None or not isinstance(decoded[0], list):
        return [], pos
    calls = [call_from_object(item) for item in decoded[0]]
    return ([], pos) if None in calls else (calls, decoded[1])


def _v11_calls(text: str, pos: int) -> tuple[list[ParsedCall], int]:
    """`[TOOL_CALLS]name[ARGS]{...}` repeated: the complete calls, and where the rest starts."""
    calls: list[ParsedCall] = []
    while text.startswith(MARKER, pos):
        name_end = text.find(ARGS, pos)
        name = text[pos + len(MARKER):name_end].strip() if name_end >= 0 else ""
        decoded = decode_json(text, name_end + len(ARGS)) if name else None
        arguments = arguments_text(decoded[0]) if decoded else None
        if arguments is None:
            break
        calls.append(ParsedCall(name, arguments))
        pos = skip_space(text, decoded[1])
    return calls, pos
