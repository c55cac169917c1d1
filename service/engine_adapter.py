"""The one place the service reaches into the engine for what it serves: load it, describe it."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine import AsyncEngine, EngineConfig
from pagedserve.engine.main_thread import MainThreadHost
from pagedserve.engine.sampling_params import MAX_LOGPROBS
from pagedserve.service.requests import ModelFacts
from pagedserve.v1 import model_info_pb2

MAX_N = 64  # SamplingParams rejects n above this


@dataclass(frozen=True, slots=True)
class EngineDescription:
    facts: ModelFacts
    info: model_info_pb2.ModelInfoResponse  # static fields only; live counts are filled per call


async def load_engine(config: EngineConfig, host: MainThreadHost | None = None) -> AsyncEngine:
    """Loads the model off the event loop (health checks keep answering NOT_SERVING meanwhile), on the host's
    main thread when there is one."""
    engine = AsyncEngine(config, host=host)
    await engine.start()
    return engine


def describe(engine: AsyncEngine, model_name: str, max_message_bytes: int) -> EngineDescription:
    config: EngineConfig = engine.config
    model = engine.describe()
    facts = ModelFacts(vocab_size=model.vocab_size, max_context_length=model.max_model_len,
                       encode=engine.tokenizer.encode, render_chat=engine.tokenizer.chat.render)
    info = model_info_pb2.ModelInfoResponse(
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
    return EngineDescription(facts, info)
