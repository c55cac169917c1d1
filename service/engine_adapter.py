"""The one place the service reaches into the engine: what a front end may call on it (`EngineHandle`, which
`AsyncEngine` fills), loading it, and describing what it serves."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from pagedserve.engine import AsyncEngine, EngineConfig, LLMEngine
from pagedserve.engine.admission import AdmittedRequest, GenerationRequest
from pagedserve.engine.async_engine import LoopHost
from pagedserve.engine.kv_events import KvEvent
from pagedserve.engine.loading.tokenizer import Tokenizer
from pagedserve.engine.outputs import EngineStats, ModelDescription, RequestOutput
from pagedserve.engine.sampling_params import MAX_LOGPROBS, MAX_N
from pagedserve.v1 import model_info_pb2


class EngineHandle(Protocol):
    """The engine as every front end sees it: admit a request once, stream it, abort it, read stats."""

    config: EngineConfig
    dead_reason: str | None  # set once the engine stopped serving

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def num_unfinished(self) -> int: ...

    def stats(self) -> EngineStats: ...

    def describe(self) -> ModelDescription: ...

    def admit(self, request: GenerationRequest) -> AdmittedRequest: ...

    def stream(self, request_id: str, request: AdmittedRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def reset_prefix_cache(self) -> int: ...

    def publish_kv_events(self, sink: Callable[[list[KvEvent]], None]) -> None: ...


async def load_engine(
    config: EngineConfig, build: Callable[[], LLMEngine], host: LoopHost | None = None
) -> EngineHandle:
    """Loads the model off the event loop (health checks keep answering NOT_SERVING meanwhile), on the host's
    main thread when there is one; `build` makes the engine there (the server's host tuning included)."""
    engine = AsyncEngine(config, host=host, build=build)
    await engine.start()
    return engine


def model_info(engine: EngineHandle, model_name: str, max_message_bytes: int) -> model_info_pb2.ModelInfoResponse:
    """ModelInfo's static fields; live counts are filled per call."""
    config, model = engine.config, engine.describe()
    return model_info_pb2.ModelInfoResponse(
        model=model_name,
        architecture=model.architecture,
        quantization=model.quantization,
        dtype=model.dtype,
        kv_cache_dtype=model.kv_cache_dtype,
        block_size=model.block_size,
        max_context_length=model.max_model_len,
        vocab_size=model.vocab_size,
        eos_token_ids=list(model.eos_token_ids),
        has_chat_template=engine.tokenizer.chat.available,
        limits=model_info_pb2.Limits(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_queued_requests=config.max_queued_requests, max_message_bytes=max_message_bytes,
            max_n=MAX_N, max_logprobs=MAX_LOGPROBS))
