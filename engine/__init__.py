"""pagedserve.engine: continuous batching over a paged KV cache.

The public names load on first use (PEP 562), so a torch-free module of this package (host/cpu_threads) can be imported
before torch: the server's entry reads the CPU budget there to choose the OpenMP wait policy, which libgomp reads
only once, when torch loads it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOMES = {
    "AdmittedRequest": "requests", "ChatPrompt": "requests", "EmbeddingRequest": "requests",
    "GenerationRequest": "requests", "PoolingParams": "pooling",
    "TextPrompt": "requests", "TokensPrompt": "requests", "AsyncEngine": "async_engine",
    "EngineConfig": "config", "LLM": "llm", "LLMEngine": "llm_engine", "CompletionOutput": "outputs",
    "EngineStats": "outputs", "RequestMetrics": "outputs", "RequestOutput": "outputs",
    "SamplingParams": "sampling_params", "LoRARequest": "lora.request", "StructuredOutputsParams": "constraint",
}
__all__ = list(_HOMES)

if TYPE_CHECKING:
    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.engine.config import EngineConfig
    from pagedserve.engine.constraint import StructuredOutputsParams
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.engine.lora.request import LoRARequest
    from pagedserve.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
    from pagedserve.engine.pooling import PoolingParams
    from pagedserve.engine.requests import (
        AdmittedRequest, ChatPrompt, EmbeddingRequest, GenerationRequest, TextPrompt, TokensPrompt,
    )
    from pagedserve.engine.sampling_params import SamplingParams


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'pagedserve.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pagedserve.engine.{_HOMES[name]}"), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
