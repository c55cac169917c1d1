"""A reasoning model's chat answer -> OpenAI chat's `reasoning` and `content` (vLLM's `--reasoning-parser`), whole or
as stream deltas.

The thought is what the model writes before its end marker (engine/reasoning.py reads the text); the rest is
content, which a tool-call format then reads as usual. A prompt that closed the thought already (Qwen3's template with
`enable_thinking: false`), or a request that turned thinking off under a format that honours it, answers everything
as content, as vLLM does. `include_reasoning: false` leaves the thought out (vLLM's request flag).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.engine.reasoning import ReasoningFormat
from pagedserve.service.core.thought_reader import ThoughtReader
from pagedserve.service.openai.openai_messages import flag


@dataclass(frozen=True, slots=True)
class ReasoningPlan:
    """One chat request's reading of thoughts: the server's format and the request's flags."""

    format: ReasoningFormat
    include: bool = True
    thinking_off: bool = False

    def reader(self, thought_closed: bool | None) -> ThoughtReader:
        """thought_closed: the engine's reading of the prompt (AdmittedRequest.thought_closed)."""
        return ThoughtReader(self.format, self.include, content_only=bool(thought_closed) or self.thinking_off)


def reasoning_plan(body: dict[str, Any], chat: bool, format: ReasoningFormat | None) -> ReasoningPlan | None:
    """None: the answer is all content (no --reasoning-parser, or a completions request, which vLLM does not split)."""
    include = flag(body, "include_reasoning", True)
    if format is None or not chat:
        return None
    kwargs = body.get("chat_template_kwargs")
    off = format.honours_enable_thinking and isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False
    return ReasoningPlan(format, include, off)
