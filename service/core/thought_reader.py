"""A reasoning model's answer read as it grows: the thought (`reasoning`) apart from the content, with what each
front end sent already (OpenAI HTTP's `reasoning` deltas, pagedserve.v1's `Delta.reasoning`). The markers are the
engine's (engine/reasoning.py); whether the prompt closed the thought is the admission's reading
(`AdmittedRequest.thought_closed`)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.reasoning import ReasoningFormat


@dataclass(slots=True)
class ThoughtReader:
    """One choice's text, read as it grows; what was sent already is remembered for the deltas."""

    format: ReasoningFormat
    include: bool = True
    content_only: bool = False  # the prompt closed the thought, or the request turned thinking off
    sent_reasoning: int = 0
    sent_content: int = 0

    def whole(self, text: str) -> tuple[str | None, str]:
        """(the thought, None when there is none or it is left out; the content)."""
        if self.content_only:
            return None, text
        split = self.format.split(text, final=True)
        return (split.reasoning or None) if self.include else None, split.content

    def advance(self, text: str, final: bool) -> tuple[str, str]:
        """(the thought's new text since the last call, the content so far)."""
        if self.content_only:
            return "", text
        split = self.format.split(text, final)
        new = split.reasoning[self.sent_reasoning:]
        self.sent_reasoning = len(split.reasoning)
        return (new if self.include else ""), split.content

    def new_content(self, content: str) -> str:
        """The content's new text since the last call (content without a tool-call format)."""
        piece = content[self.sent_content:]
        self.sent_content = len(content)
        return piece
