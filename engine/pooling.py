"""Embeddings (vLLM's pooling runner, `--runner pooling`): a request's prompt is prefilled like any other and its
final hidden states (after the model's last norm) are pooled into one vector instead of sampling a token.

`PoolerConfig` is the server's rule (vLLM's `--pooler-config`; by default read from a sentence-transformers folder's
`modules.json` and `1_Pooling/config.json`, else last-token pooling, normalized, as vLLM does for a decoder model
served as an embedding model). `PoolingParams` is a request's choice within it. The per-sequence state
(`PoolingState`) accumulates chunk by chunk, so chunked prefill and preemption (recomputed from position 0) pool
exactly what one whole forward would."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pagedserve.engine.core.seq_features import SeqFeature
from pagedserve.engine.errors import ConfigError, InvalidRequestError, ModelLoadError

RUNNERS = ("auto", "generate", "pooling")
_CONFIG_KEYS = ("pooling_type", "normalize")  # vLLM's `dimensions` default: here a request asks for a width


class PoolingType(str, enum.Enum):
    LAST = "LAST"  # the last prompt token's hidden state (decoder embedding models: Qwen3-Embedding, e5-mistral)
    MEAN = "MEAN"  # the mean over every prompt token
    CLS = "CLS"  # the first token's

    @classmethod
    def parse(cls, value: object, field: str) -> PoolingType:
        names = ", ".join(t.value for t in cls)
        if not isinstance(value, str) or value.upper() not in cls.__members__:
            raise ConfigError(field, f"unknown pooling type {value!r}; supported: {names}")
        return cls[value.upper()]


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    pooling_type: PoolingType = PoolingType.LAST
    normalize: bool = True  # L2-normalize the pooled vector (a request may say otherwise)
    # Matryoshka models: the output widths a request's `dimensions` may cut the vector to (empty: any width up to
    # the hidden size, when `matryoshka`; none at all otherwise)
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.pooling_type, PoolingType):
            object.__setattr__(self, "pooling_type", PoolingType.parse(self.pooling_type, "pooling_type"))
        if not isinstance(self.normalize, bool):
            raise ConfigError("normalize", f"must be true or false, got {self.normalize!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in self.matryoshka_dimensions):
            raise ConfigError("matryoshka_dimensions", f"must be positive widths, got {self.matryoshka_dimensions!r}")

    @classmethod
    def parse_json(cls, text: str) -> dict[str, object]:
        """`--pooler-config '{"pooling_type": "MEAN", "normalize": false}'` -> the fields it sets (checked)."""
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("pooler_config", f"not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise ConfigError("pooler_config", f"must be a JSON object, got {text!r}")
        unknown = sorted(set(fields) - set(_CONFIG_KEYS))
        if unknown:
            raise ConfigError("pooler_config", f"unsupported keys {unknown}; supported: {', '.join(_CONFIG_KEYS)}")
        cls(**fields)  # the values' checks
        return fields

    @classmethod
    def for_model(cls, model_dir: Path | None, hf_config: dict, overrides: dict[str, object]) -> PoolerConfig:
        """The folder's sentence-transformers rule (or LAST + normalize), then `--pooler-config`'s fields."""
        found = _sentence_transformers(model_dir) if model_dir is not None else {}
        dims = hf_config.get("matryoshka_dimensions") or ()
        config = cls(**found, matryoshka=bool(hf_config.get("is_matryoshka") or dims),
                     matryoshka_dimensions=tuple(dims))
        return replace(config, **overrides)

    def resolve(self, params: PoolingParams, hidden_size: int) -> PoolingPlan:
        """One request's pooling under this rule; bad values name the request's field."""
        normalize = self.normalize if params.normalize is None else params.normalize
        dims = params.dimensions
        if dims is None or dims == hidden_size:
            return PoolingPlan(self.pooling_type, normalize, None)
        if not self.matryoshka:
            raise InvalidRequestError("dimensions", f"this model's embeddings are {hidden_size} wide and it is not a "
                                      "Matryoshka model (its config sets no is_matryoshka)")
        allowed = self.matryoshka_dimensions
        if (allowed and dims not in allowed) or dims > hidden_size:
            raise InvalidRequestError("dimensions", f"got {dims}; this model supports "
                                      f"{', '.join(map(str, allowed)) if allowed else f'1 to {hidden_size}'}")
        return PoolingPlan(self.pooling_type, normalize, dims)


@dataclass(frozen=True, slots=True)
class PoolingPlan:
    """An admitted embedding's pooling: what its sequence's PoolingState starts with."""

    pooling_type: PoolingType
    normalize: bool
    dimensions: int | None  # the width to cut to (None: the whole vector)

    def start(self) -> PoolingState:
        return PoolingState(self.pooling_type, self.normalize, self.dimensions)


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """A request's pooling choices. normalize None: the server's (PoolerConfig.normalize)."""

    normalize: bool | None = None
    dimensions: int | None = None  # cut a Matryoshka embedding to its first N values (then normalize)

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError("normalize", f"must be true or false, got {self.normalize!r}")
        dims = self.dimensions
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
            raise InvalidRequestError("dimensions", f"must be an integer >= 1, got {dims!r}")


def _sentence_transformers(model_dir: Path) -> dict[str, object]:
    """A sentence-transformers folder's pooling and normalization (modules.json): pooling, then at most a
    Normalize; a module that changes the vector otherwise (Dense, ...) is refused rather than skipped."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return {}
    try:
        modules = json.loads(modules_file.read_text())
        kinds = [str(m["type"]).rsplit(".", 1)[-1] for m in modules]
        pooling = next(m for m in modules if str(m["type"]).endswith("Pooling"))
        settings = json.loads((model_dir / pooling.get("path", "1_Pooling") / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as exc:
        raise ModelLoadError(f"{modules_file}: no readable Pooling module ({exc!r})") from None
    extra = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if extra:
        raise ModelLoadError(f"{modules_file}: sentence-transformers modules {extra} change the embedding after "
                             "pooling and are not supported (Transformer, Pooling and Normalize are)")
    modes = {"pooling_mode_lasttoken": PoolingType.LAST, "pooling_mode_mean_tokens": PoolingType.MEAN,
             "pooling_mode_cls_token": PoolingType.CLS}
    chosen = [kind for key, kind in modes.items() if settings.get(key)]
    others = [key for key, on in settings.items() if key.startswith("pooling_mode_") and on and key not in modes]
    if len(chosen) != 1 or others or settings.get("include_prompt") is False:
        raise ModelLoadError(f"{model_dir / pooling.get('path', '1_Pooling')}/config.json: pooling "
                             f"{sorted(k for k, on in settings.items() if on)} is not one of last-token, mean or CLS")
    return {"pooling_type": chosen[0], "normalize": "Normalize" in kinds}


@dataclass(slots=True)
class PoolingState(SeqFeature):
    """One embedding request's pooling, filled chunk by chunk (`PooledChunk.apply`)."""

    pooling_type: PoolingType
    normalize: bool
    dimensions: int | None
    total: torch.Tensor | None = None  # fp32: the sum (MEAN) or the chosen row (LAST, CLS)
    rows: int = 0
    vector: tuple[float, ...] | None = None  # the embedding, once the whole prompt is pooled

    def fork(self, index: int) -> None:
        raise AssertionError("an embedding request has one sequence")  # n is 1: admission makes it so

    def wants(self, start: int, end: int, prompt_len: int) -> tuple[int, int] | None:
        """The positions of [start, end) this pooling reads (None: none)."""
        if self.pooling_type is PoolingType.MEAN:
            return start, end
        if self.pooling_type is PoolingType.CLS:
            return (0, 1) if start == 0 < end else None
        return (prompt_len - 1, prompt_len) if start < prompt_len <= end else None

    @property
    def needs_every_position(self) -> bool:
        """A prefix-cache hit skips positions whose hidden states MEAN and CLS read."""
        return self.pooling_type is not PoolingType.LAST

    def add(self, start: int, total: torch.Tensor, count: int) -> None:
        """`total`: the fp32 sum of the hidden states at positions start .. start + count - 1."""
        if start == 0:  # the first chunk, or the first again after a preemption: the positions are recomputed
            self.total, self.rows = None, 0
        self.total = total if self.total is None else self.total + total
        self.rows += count

    def finish(self) -> None:
        """The whole prompt is computed: the embedding, from what was pooled."""
        self.vector = self._finish()

    def _finish(self) -> tuple[float, ...]:
        vector = self.total / self.rows if self.pooling_type is PoolingType.MEAN else self.total
        if self.dimensions is not None:
            vector = vector[: self.dimensions]
        if self.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        values = vector.tolist()
        return tuple(v if math.isfinite(v) else float("nan") for v in values)
