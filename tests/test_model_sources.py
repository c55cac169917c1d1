"""Where a model's weights and tokenizer come from: --tokenizer for checkpoints saved without one, and the errors
for folders that cannot be served, each naming the file or the flag to pass."""

from __future__ import annotations

import pytest

from conftest import make_tiny_model
from quant_fixtures import copy_fixture, fixture_dir
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import ConfigError, ModelLoadError
from pagedserve.engine.loading.model_store import TOKENIZER_SOURCES, resolve_model
from pagedserve.service.cli import build_parser, engine_config

AWQ = "awq_4bit_g64"


@pytest.fixture
def awq_without_tokenizer(tmp_path):
    """An AutoAWQ output folder as the tool saves it when nobody saves the tokenizer beside it."""
    folder = copy_fixture(AWQ, tmp_path / "awq")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink()
    return folder


def test_a_folder_without_tokenizer_asks_for_the_tokenizer_flag(awq_without_tokenizer):
    with pytest.raises(ModelLoadError, match=r"has no tokenizer .*pass --tokenizer DIR"):
        LLM(str(awq_without_tokenizer), dtype="float32")


def test_tokenizer_flag_serves_a_folder_saved_without_one(awq_without_tokenizer):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(fixture_dir(AWQ)))
    llm = LLM(str(awq_without_tokenizer), dtype="float32", tokenizer=str(fixture_dir(AWQ)))
    text = reference.decode(list(range(10, 20)))
    assert llm.engine.tokenizer.encode(text) == reference.encode(text)
    [out] = llm.generate([text], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4


def test_tokenizer_dir_must_hold_a_tokenizer(awq_without_tokenizer, tmp_path):
    with pytest.raises(ModelLoadError, match=f"tokenizer: {tmp_path} has none of {', '.join(TOKENIZER_SOURCES)}"):
        resolve_model(str(awq_without_tokenizer), tokenizer=str(tmp_path))
    with pytest.raises(ConfigError) as info:
        EngineConfig(tokenizer=str(tmp_path / "missing"))
    assert info.value.field == "tokenizer"


def test_tokenizer_flag_reaches_the_engine_config(tmp_path):
    args = build_parser().parse_args(["serve", "--tokenizer", str(tmp_path)])
    assert engine_config(args).tokenizer == str(tmp_path)


def test_a_truncated_safetensors_file_is_named(tmp_path):
    path = make_tiny_model(tmp_path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: unreadable safetensors file"):
        LLM(str(path), dtype="float32")


def test_a_corrupt_safetensors_header_is_named(tmp_path):
    path = make_tiny_model(tmp_path)
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: unreadable safetensors file"):
        LLM(str(path), dtype="float32")


def test_unservable_paths_say_why(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelLoadError, match="does not exist .*embedded models: SmolLM2-135M-Instruct, gemma-3-270m"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match="neither an HF folder .* nor holds a .gguf"):
        resolve_model(str(tmp_path))
