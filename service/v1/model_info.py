"""pagedserve.v1 ModelInfo's static fields, from the engine's description and limits (live counts are filled per
call by the servicer)."""

from __future__ import annotations

from pagedserve.engine.sampling_params import MAX_LOGPROBS, MAX_N
from pagedserve.service.core.engine_handle import EngineHandle
from pagedserve.v1 import model_info_pb2


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
        runner=model.runner,
        embedding_size=model.embedding_size,
        pooling_type=model.pooling_type,
        limits=model_info_pb2.Limits(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_queued_requests=config.max_queued_requests, max_message_bytes=max_message_bytes,
            max_n=MAX_N, max_logprobs=MAX_LOGPROBS))
