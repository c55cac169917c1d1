"""docs/architecture.md's how-to lists name every file a newcomer touches: each named file exists (or, for a file to
create, the folder it goes into; for a new package, the folder that package goes into)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
HOWTOS = ("a model architecture", "an attention backend", "a quant method", "a front end", "a constraint backend",
          "an adapter format", "a CPU kernel ISA")


def howto_files(text: str) -> dict[str, list[tuple[str, str]]]:
    """'How to add X' -> [(path, the rest of its line)] for each list item that starts with a path."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            match = re.match(r"## How to add (.+?)(?: \(.*\))?$", line)
            current = match.group(1) if match else None
            if current is not None:
                sections[current] = []
        elif current is not None and line.startswith("- `"):
            head = line[2:].split(" (new", 1)[0].split(":", 1)[0]
            rest = line[len(head) + 2:]
            for path in re.findall(r"`([^`]+)`", head):
                sections[current].append((path, rest))
    return sections


def missing(path: str, rest: str, root: Path = ROOT) -> str | None:
    """Why a named path does not hold, or None. A file marked (new) needs its folder; (new package) the folder the
    package goes into."""
    if not rest.startswith(" (new"):
        if "<" in path:
            return f"{path} is a placeholder but not marked (new)"
        return None if (root / path).exists() else f"{path} does not exist"
    prefix = path.split("<", 1)[0]
    folder = Path(prefix.rstrip("/")) if prefix.endswith("/") else Path(path).parent
    if rest.startswith(" (new package)") and not (root / folder).is_dir():
        folder = folder.parent
    return None if (root / folder).is_dir() else f"{path}: the folder {folder} does not exist"


def test_every_howto_is_there_and_names_its_files():
    sections = howto_files(ARCHITECTURE.read_text())
    assert set(HOWTOS) <= set(sections), f"missing how-tos: {set(HOWTOS) - set(sections)}"
    for name in HOWTOS:
        assert sections[name], f"'How to add {name}' names no file"


def test_every_named_file_exists():
    problems = [f"How to add {name}: {why}" for name, files in howto_files(ARCHITECTURE.read_text()).items()
                for path, rest in files if (why := missing(path, rest))]
    assert not problems, "\n".join(problems)


def test_the_parser_and_the_check_catch_what_they_look_for(tmp_path):
    text = ("## How to add a thing (soon)\n\n- `engine/llm.py`: edit\n- `kernels/<x>.py` (new): make\n"
            "- `a/b.py`, `engine/nope.py`: both\nnot an item `engine/hidden.py`\n## Other\n- `x/y.py`: no\n")
    files = howto_files(text)
    assert [p for p, _ in files["a thing"]] == ["engine/llm.py", "kernels/<x>.py", "a/b.py", "engine/nope.py"]
    assert "Other" not in files
    assert missing("engine/llm.py", ": edit") is None
    assert missing("engine/nope.py", ": both") == "engine/nope.py does not exist"
    assert missing("kernels/<x>.py", " (new): make") is None
    assert missing("kernels/<x>.py", ": make").endswith("not marked (new)")
    assert missing("nowhere/<x>.py", " (new): make") == "nowhere/<x>.py: the folder nowhere does not exist"
    assert missing("engine/constraints/<b>.py", " (new package): make") is None
    assert missing("tests/test_new_thing.py", " (new): make") is None
    assert missing("nowhere/pkg/<b>.py", " (new package): make") is not None
