"""transformers' config class for a model type, filled from a GGUF file's fields: made once per (model type, fields,
transformers version) and kept in pagedserve's cache as JSON.

Why a cache: importing a transformers config class (LlamaConfig, Gemma3TextConfig, ...) imports its validators,
which import transformers' activations, kernel hub and model-loading stack and with them torch.distributed.tensor:
~2-4 s of every `pagedserve serve` start on a GGUF file (py-spy, -X importtime and cold/warm loads, 2-core SPR
guest), where nothing else at start-up needs them (the tokenizer loads without them). The JSON holds exactly what the class produced:
a dict that does not survive a JSON round trip unchanged is not cached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

from pagedserve.kernels.cache_dir import cache_root

logger = logging.getLogger(__name__)

_FORMAT = 1  # bump when what is stored changes


def filled_config(model_type: str, fields: dict[str, Any]) -> dict[str, Any]:
    """AutoConfig.for_model(model_type, **fields).to_dict(), from the cache when an earlier call stored it."""
    try:
        key = json.dumps([model_type, fields, version("transformers"), _FORMAT], sort_keys=True)
    except TypeError:  # a field JSON cannot hold: build it every time
        return _build(model_type, fields)
    path = cache_root() / "hf-configs" / f"{model_type}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        return _from_json(path.read_text())
    except (OSError, ValueError):  # absent, unreadable or torn: build it again
        pass
    config = _build(model_type, fields)
    _store(path, config)
    return config


def _from_json(text: str) -> dict[str, Any]:
    """The stored dict, id2label's keys back to int as transformers' own config loading makes them (JSON's object
    keys are strings)."""
    config = json.loads(text)
    if isinstance(config.get("id2label"), dict):
        config["id2label"] = {int(k): v for k, v in config["id2label"].items()}
    return config


def _build(model_type: str, fields: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **fields).to_dict()


def _store(path: Path, config: dict[str, Any]) -> None:
    """Written to a temporary sibling and renamed (a reader never sees half a file); a failure only costs the next
    start the import again."""
    try:
        text = json.dumps(config, sort_keys=True)
        if _from_json(text) != config:  # e.g. tuples or other int keys: the cached copy would differ
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".config-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as exc:
        logger.debug("config of %s not cached: %s", path.name, exc)
