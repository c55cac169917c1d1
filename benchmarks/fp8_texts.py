"""The FP8 KV text set (benchmarks/fp8_texts.json): resolve each entry, check it, render it to token ids.

The texts are committed under benchmarks/fp8_texts/ (their origins and licenses: SOURCES.md there), so the set is
the same on every machine and Python version; the manifest pins each file by sha256, so an edited file is reported,
not silently measured.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MANIFEST = Path(__file__).resolve().parent / "fp8_texts.json"
TEXTS = MANIFEST.with_suffix("")  # benchmarks/fp8_texts/
ROLES = ("selection", "evaluation")
RENDERS = ("plain", "chat")


class TextSetError(ValueError):
    """The manifest is malformed; the message names the entry and field."""


@dataclass(frozen=True, slots=True)
class TextEntry:
    name: str
    kind: str
    role: str
    path: str  # relative to benchmarks/fp8_texts/
    sha256: str
    render: str
    chars: tuple[int, int]
    question_regex: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise TextSetError(f"{self.name}: role {self.role!r}; expected one of {ROLES}")
        if self.render not in RENDERS:
            raise TextSetError(f"{self.name}: render {self.render!r}; expected one of {RENDERS}")
        if self.render == "chat" and not self.question_regex:
            raise TextSetError(f"{self.name}: render 'chat' needs question_regex")
        if not (0 <= self.chars[0] < self.chars[1]):
            raise TextSetError(f"{self.name}: chars {list(self.chars)} is not a slice [start, end)")
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise TextSetError(f"{self.name}: sha256 must be 64 hex digits")

    @property
    def file(self) -> Path:
        return TEXTS / self.path

    def problem(self) -> str | None:
        """Why this text cannot be read as pinned (missing file, different content), or None."""
        if not self.file.is_file():
            return f"{self.name}: {self.file} is missing"
        digest = hashlib.sha256(self.file.read_bytes()).hexdigest()
        if digest != self.sha256:
            return f"{self.name}: {self.file} has sha256 {digest[:12]}..., the manifest pins {self.sha256[:12]}..."
        return None

    def text(self) -> str:
        return self.file.read_bytes().decode("utf-8")[self.chars[0] : self.chars[1]]

    def turns(self) -> list[dict[str, str]]:
        """Question/answer pairs as alternating user/assistant messages."""
        pattern = re.compile(self.question_regex)
        turns: list[dict[str, str]] = []
        for line in self.text().splitlines():
            if pattern.match(line):
                turns += [{"role": "user", "content": line.strip()}, {"role": "assistant", "content": ""}]
            elif turns:
                turns[-1]["content"] += line.strip() + "\n" if line.strip() else "\n"
        return [{"role": t["role"], "content": re.sub(r"\n{3,}", "\n\n", t["content"]).strip()} for t in turns]


@dataclass(frozen=True, slots=True)
class TextSet:
    max_tokens: int
    texts: tuple[TextEntry, ...]

    def role(self, role: str) -> tuple[TextEntry, ...]:
        return tuple(t for t in self.texts if t.role == role)

    def problems(self) -> list[str]:
        return [p for p in (t.problem() for t in self.texts) if p is not None]


def load_manifest(path: Path = MANIFEST) -> TextSet:
    raw = json.loads(path.read_text())
    entries = []
    for item in raw["texts"]:
        fields = {k: v for k, v in item.items()}
        fields["chars"] = tuple(fields["chars"])
        try:
            entries.append(TextEntry(**fields))
        except TypeError as exc:
            raise TextSetError(f"{item.get('name', '?')}: {exc}") from None
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise TextSetError("text names must be unique")
    return TextSet(int(raw["max_tokens"]), tuple(entries))


def token_ids(entry: TextEntry, encode: Callable[[str], list[int]],
              chat: Callable[[list[dict[str, str]]], list[int]], max_tokens: int) -> list[int]:
    """The entry rendered and tokenized, cut to max_tokens."""
    ids = chat(entry.turns()) if entry.render == "chat" else encode(entry.text())
    return ids[:max_tokens]
