"""One choice's text, read by a tool-call format as it grows -> OpenAI's `tool_calls` (whole, or stream deltas).

Deltas are what OpenAI streams: content pieces, and per call a first entry with `index`, `id`, `type` and the
function's name (and the arguments known so far), then entries with more `arguments` text for the same index.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from pagedserve.service.openai.tool_parsers.base import Parsed, ToolParser


@dataclass(slots=True)
class ToolCallStream:
    parser: ToolParser
    ids: list[str] = field(default_factory=list)  # one per call seen, the same in deltas and whole messages
    sent_content: int = 0
    sent_arguments: list[int] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """What text adds since the last call: {"content": ...} and/or {"tool_calls": [...]}, or {}."""
        parsed = self.parser.parse(text, final)
        out: dict[str, Any] = {}
        if len(parsed.content) > self.sent_content:
            out["content"] = parsed.content[self.sent_content:]
            self.sent_content = len(parsed.content)
        calls = self._call_deltas(parsed)
        if calls:
            out["tool_calls"] = calls
        return out

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The whole message: (content, tool_calls); content None when calls and whitespace are all there is."""
        parsed = self.parser.parse(text, final=True)
        self._ensure_ids(len(parsed.calls))
        calls = [{"id": self.ids[i], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for i, c in enumerate(parsed.calls)]
        if calls and not parsed.content.strip():
            return None, calls
        return parsed.content, calls

    def _call_deltas(self, parsed: Parsed) -> list[dict[str, Any]]:
        deltas = []
        for index, call in enumerate(parsed.calls):
            if index >= len(self.ids):
                self._ensure_ids(index + 1)
                self.sent_arguments.append(len(call.arguments))
                deltas.append({"index": index, "id": self.ids[index], "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self.sent_arguments[index]:
                deltas.append({"index": index, "function": {"arguments": call.arguments[self.sent_arguments[index]:]}})
                self.sent_arguments[index] = len(call.arguments)
        return deltas

    def _ensure_ids(self, count: int) -> None:
        while len(self.ids) < count:
            self.ids.append(self.parser.call_id(len(self.ids), secrets.token_hex(16)))
