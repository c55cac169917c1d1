"""pagedserve.engine: continuous batching over a paged KV cache."""

from pagedserve.engine.admission import AdmittedRequest, ChatPrompt, GenerationRequest, TextPrompt, TokensPrompt
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.llm import LLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams

__all__ = [
    "AdmittedRequest", "ChatPrompt", "GenerationRequest", "TextPrompt", "TokensPrompt", "AsyncEngine", "EngineConfig",
    "LLM", "LLMEngine", "CompletionOutput", "EngineStats", "RequestMetrics", "RequestOutput", "SamplingParams",
]
