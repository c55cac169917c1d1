"""Hub ids served from a Hugging Face cache already on disk, so `vllm serve Qwen/Qwen2.5-0.5B-Instruct` launch
lines (and their `--revision`, `--download-dir`) start unchanged where the weights were downloaded beforehand, as
on a mounted model volume or an image built with them. Nothing is ever fetched: huggingface_hub's own reader
(`snapshot_download(local_files_only=True)`) maps the id and revision to the cached snapshot folder, so the cache
is read exactly as the tools that wrote it lay it out. A GGUF repository takes vLLM's `org/name:QUANT` form
(`unsloth/Qwen3-0.6B-GGUF:Q4_K_M`), which picks the file of that quantization."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pagedserve.engine.errors import ConfigError, ModelLoadError

# huggingface_hub's repo-id rule (one or two names of these characters, not starting with - or .); anything else
# is a local path
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO_ID = re.compile(rf"{_NAME}(?:/{_NAME})?")
_GGUF_REPO = re.compile(rf"({_NAME}/{_NAME}):([A-Za-z0-9_+-]+)")  # vLLM's repo_id:quant_type


@dataclass(frozen=True, slots=True)
class HubCache:
    """Where and which version to look: `cache_dir` is vLLM's --download-dir (None: huggingface_hub's default,
    HF_HUB_CACHE or HF_HOME/hub or ~/.cache/huggingface/hub); `revision` a branch, tag or full commit hash (None:
    main)."""

    cache_dir: str | None = None
    revision: str | None = None

    def __post_init__(self) -> None:
        for name in ("cache_dir", "revision"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(name, f"must be a non-empty string or None, got {value!r}")


def is_hub_id(name: str) -> bool:
    """An `org/name`, `name` or `org/name:QUANT` that is not a path on this machine."""
    return not Path(name).expanduser().exists() and bool(_REPO_ID.fullmatch(name) or _GGUF_REPO.fullmatch(name))


def cached_model(name: str, hub: HubCache) -> Path:
    """The snapshot folder of hub id `name`, or for `org/name:QUANT` the GGUF file of that quantization in it."""
    gguf = _GGUF_REPO.fullmatch(name)
    if gguf is None:
        return cached_snapshot(name, hub)
    return _quant_file(cached_snapshot(gguf.group(1), hub), gguf.group(2), name)


def cached_snapshot(repo_id: str, hub: HubCache, field: str = "model") -> Path:
    """The snapshot folder of `repo_id` at `hub.revision`; errors name `field` (model or tokenizer)."""
    from huggingface_hub import snapshot_download  # transformers' own dependency; imported only for hub ids
    from huggingface_hub import errors as hub_errors

    try:
        return Path(snapshot_download(repo_id, revision=hub.revision, cache_dir=hub.cache_dir,
                                      local_files_only=True))
    except (hub_errors.LocalEntryNotFoundError, hub_errors.HFValidationError) as exc:
        where = hub.cache_dir or "the Hugging Face cache (HF_HUB_CACHE, HF_HOME/hub or ~/.cache/huggingface/hub)"
        revision = f" at revision {hub.revision!r}" if hub.revision else ""
        # a snapshot whose cached file listing names missing files (an interrupted download); newer hubs only
        detail = f" ({exc})" if isinstance(exc, getattr(hub_errors, "IncompleteSnapshotError", ())) else ""
        raise ModelLoadError(f"{field}: {repo_id}{revision} is neither a local path nor cached in {where}{detail}; "
                             "hub ids are served from a cache downloaded beforehand (`hf download "
                             f"{repo_id}`), never fetched") from None


def _quant_file(snapshot: Path, quant: str, name: str) -> Path:
    """vLLM's choice: files named *-QUANT.gguf or *-QUANT-*.gguf (also one folder down), unsharded first."""
    patterns = (f"*-{quant}.gguf", f"*-{quant}-*.gguf", f"*/*-{quant}.gguf", f"*/*-{quant}-*.gguf")
    found = sorted({str(p.relative_to(snapshot)) for pattern in patterns for p in snapshot.glob(pattern)},
                   key=lambda rel: (rel.count("-"), rel))
    if not found:
        held = sorted(p.name for p in snapshot.rglob("*.gguf"))
        raise ModelLoadError(f"model: {name}: the cached snapshot {snapshot} holds no *-{quant}.gguf file"
                             + (f" (it holds {', '.join(held)})" if held else " (no .gguf files)"))
    return snapshot / found[0]
