"""A GGUF file's HF config is transformers' config class filled from the file's fields, built once and then read
from pagedserve's cache (engine/loading/config_defaults.py): the same dict either way, and a start with the cache
warm never imports the config classes (their import is ~2 s of a server start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedserve.engine.loading import config_defaults

FIELDS = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
          "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "tie_word_embeddings": True}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    return tmp_path / "hf-configs"


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text"])
def test_cold_and_warm_equal_transformers(cache, model_type):
    from transformers import AutoConfig

    expected = AutoConfig.for_model(model_type, **FIELDS).to_dict()
    cold = config_defaults.filled_config(model_type, FIELDS)
    assert len(list(cache.glob(f"{model_type}-*.json"))) == 1
    warm = config_defaults.filled_config(model_type, FIELDS)
    assert cold == warm == expected
    assert all(isinstance(k, int) for k in warm["id2label"])  # as transformers makes them, not JSON's strings


def test_other_fields_are_another_entry(cache):
    config_defaults.filled_config("llama", FIELDS)
    other = config_defaults.filled_config("llama", FIELDS | {"hidden_size": 128})
    assert other["hidden_size"] == 128 and len(list(cache.iterdir())) == 2


def test_a_torn_entry_is_built_again(cache):
    expected = config_defaults.filled_config("llama", FIELDS)
    (entry,) = cache.iterdir()
    entry.write_text('{"hidden_size": 6')
    assert config_defaults.filled_config("llama", FIELDS) == expected
    assert json.loads(entry.read_text())["hidden_size"] == 64


def test_a_dict_json_would_change_is_not_stored(cache, monkeypatch):
    monkeypatch.setattr(config_defaults, "_build", lambda model_type, fields: {"layer_types": ("full", "sliding")})
    assert config_defaults.filled_config("llama", FIELDS) == {"layer_types": ("full", "sliding")}
    assert not cache.exists() or not list(cache.iterdir())


def test_a_warm_start_does_not_import_the_config_classes(default_model, tmp_path):
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from pagedserve.engine.loading.gguf_archs import hf_config\n"
        "from pagedserve.engine.loading.gguf_file import GgufFile\n"
        f"f = GgufFile(Path({str(default_model.weights)!r}))\n"
        "config = hf_config(f.architecture, f.metadata, f.tensor_names)\n"
        "print(config['hidden_size'], 'transformers.models.llama.configuration_llama' in sys.modules)\n"
    )
    env = {**os.environ, "PAGEDSERVE_CACHE": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300,
                           cwd=tmp_path) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr
    assert [r.stdout.split() for r in runs] == [["576", "True"], ["576", "False"]]
