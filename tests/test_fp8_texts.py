"""The FP8 KV text set (benchmarks/fp8_texts.json): valid, held-out texts kept apart, every file committed as pinned."""

from __future__ import annotations

import dataclasses
import json

import pytest

import bench_paths  # noqa: F401 - puts benchmarks/ on sys.path
import fp8_texts
from pagedserve.engine.loading.model_store import resolve_model
from pagedserve.engine.loading.tokenizer import Tokenizer

KINDS = ("prose", "code", "structured", "chat", "non-English")


def test_selection_and_evaluation_cover_every_kind_from_different_files() -> None:
    text_set = fp8_texts.load_manifest()
    for role in fp8_texts.ROLES:
        kinds = [t.kind.split(" ")[0] for t in text_set.role(role)]
        assert sorted(kinds) == sorted(KINDS), (role, kinds)
    selection_files = {t.path for t in text_set.role("selection")}
    assert not selection_files & {t.path for t in text_set.role("evaluation")}


def test_every_text_is_committed_as_pinned_and_renders_to_enough_tokens() -> None:
    text_set = fp8_texts.load_manifest()
    assert text_set.problems() == []
    tok = Tokenizer(resolve_model(None).tokenizer_dir, vocab_size=49152)
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    for entry in text_set.texts:
        ids = fp8_texts.token_ids(entry, encode, tok.apply_chat_template, text_set.max_tokens)
        assert 1000 <= len(ids) <= text_set.max_tokens, (entry.name, len(ids))
        if entry.render == "chat":
            turns = entry.turns()
            assert len(turns) >= 8 and all(t["content"] for t in turns), entry.name
            assert [t["role"] for t in turns[:4]] == ["user", "assistant", "user", "assistant"]


def test_a_changed_or_missing_file_is_named(tmp_path) -> None:
    entry = fp8_texts.load_manifest().texts[0]
    moved = dataclasses.replace(entry, path=str(tmp_path / "gone.txt"))
    assert moved.problem() == f"{entry.name}: {tmp_path / 'gone.txt'} is missing"
    (tmp_path / "other.txt").write_text("different content")
    changed = dataclasses.replace(entry, path=str(tmp_path / "other.txt"))
    assert "has sha256" in changed.problem() and entry.name in changed.problem()


def test_malformed_entries_name_the_field(tmp_path) -> None:
    raw = json.loads(fp8_texts.MANIFEST.read_text())
    raw["texts"][1]["role"] = "training"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    with pytest.raises(fp8_texts.TextSetError, match=f"{raw['texts'][1]['name']}: role 'training'"):
        fp8_texts.load_manifest(bad)
    raw["texts"][1]["role"] = "selection"
    raw["texts"][1]["chars"] = [5, 5]
    bad.write_text(json.dumps(raw))
    with pytest.raises(fp8_texts.TextSetError, match="chars"):
        fp8_texts.load_manifest(bad)
