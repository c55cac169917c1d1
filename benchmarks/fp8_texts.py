"""The FP8 KV text set (benchmarks/fp8_texts.json): resolve each entry on this image, check it, render it to token ids.

Every text is read from a file that ships with Python or a Debian package, so nothing large is committed; the
manifest pins each file by sha256, so a different file under the same path is reported, not silently measured.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import site
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MANIFEST = Path(__file__).resolve().parent / "fp8_texts.json"
ROLES = ("selection", "evaluation")
RENDERS = ("plain", "chat")


class TextSetError(ValueError):
    """The manifest is malformed; the message names the entry and field."""


@dataclass(frozen=True, slots=True)
class TextEntry:
    name: str
    kind: str
    role: str
    path: str  # may start with {stdlib} or {purelib}
    sha256: str
    render: str
    chars: tuple[int, int]
    gzip: bool = False
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
        """The file on this image; {purelib} is searched in every site-packages this interpreter reads (a venv made
        with --system-site-packages has the system's too)."""
        paths = sysconfig.get_paths()
        candidates = [Path(self.path.format(stdlib=paths["stdlib"], purelib=lib))
                      for lib in dict.fromkeys([paths["purelib"], *site.getsitepackages()])]
        return next((c for c in candidates if c.is_file()), candidates[0])

    def problem(self) -> str | None:
        """Why this text cannot be rebuilt here (missing file, different content), or None."""
        if not self.file.is_file():
            return f"{self.name}: {self.file} is not on this image"
        digest = hashlib.sha256(self.file.read_bytes()).hexdigest()
        if digest != self.sha256:
            return f"{self.name}: {self.file} has sha256 {digest[:12]}..., the manifest pins {self.sha256[:12]}..."
        return None

    def text(self) -> str:
        raw = self.file.read_bytes()
        data = (gzip.decompress(raw) if self.gzip else raw).decode("utf-8")
        return data[self.chars[0] : self.chars[1]]

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
