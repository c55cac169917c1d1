"""One process parses a tokenizer's files once (engine/loading/tokenizer.py): engines over the same files share
transformers' tokenizer, and any change to those files, or a folder that failed, is parsed again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.loading.tokenizer import Tokenizer

VOCAB = 49152
TEXT = "The quick brown fox jumps over the lazy dog: 12 + 30 = 42."


def _copy(default_model, into: Path) -> Path:
    shutil.copytree(default_model.tokenizer_dir, into)
    return into


def test_folders_with_the_same_files_share_one_parse_that_equals_a_fresh_one(default_model, tmp_path):
    first = Tokenizer(_copy(default_model, tmp_path / "a"), VOCAB)
    second = Tokenizer(_copy(default_model, tmp_path / "b"), VOCAB)
    assert second.hf is first.hf
    (tmp_path / "b" / "model.safetensors").write_bytes(b"weights are not tokenizer files")
    assert Tokenizer(tmp_path / "b", VOCAB).hf is first.hf
    fresh = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert second.encode(TEXT) == fresh(TEXT)["input_ids"]
    assert second.eos_token_ids == {fresh.eos_token_id}


def test_a_changed_file_is_parsed_again(default_model, tmp_path):
    folder = _copy(default_model, tmp_path / "tok")
    before = Tokenizer(folder, VOCAB)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|im_start|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    after = Tokenizer(folder, VOCAB)
    assert after.hf is not before.hf
    assert after.hf.eos_token == "<|im_start|>" and before.hf.eos_token != "<|im_start|>"


def test_a_broken_folder_is_an_error_each_time_until_it_is_mended(default_model, tmp_path):
    folder = _copy(default_model, tmp_path / "tok")
    good = (folder / "tokenizer.json").read_bytes()
    (folder / "tokenizer.json").write_text("{not json")
    for _ in range(2):
        with pytest.raises(ModelLoadError, match="tokenizer in"):
            Tokenizer(folder, VOCAB)
    (folder / "tokenizer.json").write_bytes(good)
    assert Tokenizer(folder, VOCAB).encode(TEXT) == Tokenizer(default_model.tokenizer_dir, VOCAB).encode(TEXT)
