"""Reasoning models' thought markers (vLLM's `--reasoning-parser`): where a thought ends, whether the prompt already
closed one, and which part of a text is the thought.

A reasoning model writes its thought between two markers (`<think>` ... `</think>`); chat templates often write the
opening marker into the prompt, so the output may start inside the thought. Two readers:
- the engine holds a constrained request's grammar back until the output closes the thought (as vLLM's
  structured-output manager does), unless the prompt closed it already (Qwen3 with `enable_thinking: false` renders
  an empty thought into the prompt);
- the OpenAI front end splits each choice's text into `reasoning` and `content` (`split`).
Markers are matched as text, so they work whether the tokenizer holds them as single tokens (every reasoning
model's does) or spells them in pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.errors import ConfigError
from pagedserve.kernels.registry import Registry


@dataclass(frozen=True, slots=True)
class ThoughtSplit:
    """One text read as a thought and what follows it. `closed`: the end marker was seen (content follows)."""

    reasoning: str
    content: str
    closed: bool


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    # A request that turns thinking off (chat_template_kwargs enable_thinking: false) gets an unclosed text as
    # content rather than as a thought cut short (vLLM's qwen3 parser; deepseek_r1 keeps it a thought).
    honours_enable_thinking: bool = False

    def __post_init__(self) -> None:
        if not self.start or not self.end or self.start == self.end:
            raise ConfigError("reasoning_parser", f"{self.name}: needs two different, non-empty markers")

    def closed_in(self, text: str) -> bool:
        """Whether `text` ends outside a thought: its last end marker comes after its last start marker."""
        end = text.rfind(self.end)
        return end != -1 and end > text.rfind(self.start)

    def opened_in(self, text: str) -> bool:
        """Whether `text` ends inside a thought: its last start marker comes after its last end marker."""
        start = text.rfind(self.start)
        return start != -1 and start > text.rfind(self.end)

    def split(self, text: str, final: bool) -> ThoughtSplit:
        """An output read as thought, then content. A leading start marker is dropped (the model may open the thought
        itself, or the prompt did). While the text grows (`final` False), a tail that could still become a marker is
        held back, so what is returned only grows as the text does."""
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif not final and self.start.startswith(body):
            return ThoughtSplit("", "", False)  # nothing but (part of) the opening marker yet
        else:
            body = text
        reasoning, marker, content = body.partition(self.end)
        if marker:
            return ThoughtSplit(reasoning, content, True)
        return ThoughtSplit(body if final else body[:len(body) - _partial_marker(body, self.end)], "", False)


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `marker` (0: none)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass(frozen=True, slots=True)
class ThoughtMarker:
    """A thought marker as the engine watches the output for it (where a held-back grammar starts, where a budget
    starts counting or stops): `text` appearing in the output, or `token_id`, the marker as one token of the
    vocabulary, appended (a tokenizer may hide it from the text as a special token). `token_ids`: the marker as the
    tokenizer writes it alone (what a spent budget forces)."""

    text: str
    token_ids: tuple[int, ...] = ()

    @property
    def token_id(self) -> int | None:
        return self.token_ids[0] if len(self.token_ids) == 1 else None

    @property
    def reach(self) -> int:
        """How many characters before a new token's text the marker may start and still end in it."""
        return len(self.text) - 1

    def seen(self, token: int, tail: str) -> bool:
        """tail: the output's text from `reach` characters before the new token's text to its end."""
        return token == self.token_id or self.text in tail


REASONING_FORMATS: Registry[ReasoningFormat] = Registry("reasoning parser")
for _format in (ReasoningFormat("deepseek_r1", "<think>", "</think>"),
                ReasoningFormat("qwen3", "<think>", "</think>", honours_enable_thinking=True)):
    REASONING_FORMATS.register(_format.name)(_format)
