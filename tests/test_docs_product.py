"""docs/ describes the product as it is: no file name and no heading names a work session, a work period, a
follow-up or an issue number (history lives in git and in the dated raw results under benchmarks/results/), and the
README's docs index lists every page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
HISTORY_WORDS = re.compile(r"session|issue|follow-?up|period", re.IGNORECASE)


def headings(text: str) -> list[str]:
    """Markdown headings outside fenced code blocks."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append(line)
    return found


def history_names(names: list[str]) -> list[str]:
    return [name for name in names if HISTORY_WORDS.search(name)]


def test_no_docs_file_name_names_history():
    bad = history_names(sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*") if p.is_file()))
    assert not bad, f"docs/ files named after history (move raw results to benchmarks/results/<date>-...): {bad}"


def test_no_heading_names_history():
    bad = [f"{page.name}: {h}" for page in sorted(DOCS.glob("*.md")) for h in history_names(headings(page.read_text()))]
    assert not bad, "\n".join(bad)


def test_the_readme_indexes_every_page():
    readme = (ROOT / "README.md").read_text()
    missing = [page.name for page in sorted(DOCS.glob("*.md")) if f"`docs/{page.name}`" not in readme]
    assert not missing, f"README.md's docs index lacks {missing}"


def test_the_checks_catch_what_they_look_for():
    text = "# Benchmarks\n## Session 8 on Zen 4\n```bash\n# issue 7: a comment, not a heading\n```\n### Follow-up run\n"
    assert headings(text) == ["# Benchmarks", "## Session 8 on Zen 4", "### Follow-up run"]
    assert history_names(headings(text)) == ["## Session 8 on Zen 4", "### Follow-up run"]
    assert history_names(["benchmarks-zen4-session9.json", "soak.md", "work-period-3.md", "issue-17.md"]) == [
        "benchmarks-zen4-session9.json", "work-period-3.md", "issue-17.md"]
