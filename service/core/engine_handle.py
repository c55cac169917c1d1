"""What a front end may call on the engine (`EngineHandle`, which `AsyncEngine` fills) and loading it. Front ends
take the engine as an EngineHandle; the types they read (outputs, stats, the admission's requests) are the engine's
own dataclasses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from pagedserve.engine import AsyncEngine, EngineConfig, LLMEngine
from pagedserve.engine.async_engine import LoopHost
from pagedserve.engine.kv_events import KvEvent
from pagedserve.engine.loading.tokenizer import Tokenizer
from pagedserve.engine.lora.config import AdapterInfo, LoraModule
from pagedserve.engine.outputs import EngineStats, ModelDescription, RequestOutput
from pagedserve.engine.requests import AdmittedRequest, EmbeddingRequest, GenerationRequest


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

    def admit(self, request: GenerationRequest | EmbeddingRequest) -> AdmittedRequest: ...

    def stream(self, request_id: str, request: AdmittedRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def reset_prefix_cache(self) -> int: ...

    def publish_kv_events(self, sink: Callable[[list[KvEvent]], None]) -> None: ...

    def observe_steps(self, sink: Callable[[int, int], None]) -> None: ...

    async def load_adapter(self, module: LoraModule) -> AdapterInfo: ...

    async def unload_adapter(self, name: str) -> None: ...

    def adapters(self) -> tuple[AdapterInfo, ...]: ...


async def load_engine(
    config: EngineConfig, build: Callable[[], LLMEngine], host: LoopHost | None = None
) -> EngineHandle:
    """Loads the model off the event loop (health checks keep answering NOT_SERVING meanwhile), on the host's
    main thread when there is one; `build` makes the engine there (the server's host tuning included)."""
    engine = AsyncEngine(config, host=host, build=build)
    await engine.start()
    return engine

