"""pagedserve.v1 GenerationService: Generate (admitted by requests.py, streamed by stream.py, framed by frames.py),
Tokenize and ModelInfo."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator

import grpc

from pagedserve.engine.request_id import check_request_id
from pagedserve.service import rpc_status
from pagedserve.engine.outputs import EngineStats
from pagedserve.service.engine_adapter import EngineHandle, model_info
from pagedserve.service.frames import FrameBuilder
from pagedserve.service.lifecycle import SERVICE_NAME, ServingState
from pagedserve.service.metrics import ServiceMetrics
from pagedserve.service.requests import admit, input_chars
from pagedserve.service.stream import RequestStream
from pagedserve.service.wire import parse_request
from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import model_info_pb2, tokenize_pb2

REQUEST_ID_METADATA = "x-request-id"
_LONG_TEXT_CHARS = 16_384  # tokenize longer prompts off the event loop


class GenerationServicer:
    def __init__(self, state: ServingState, metrics: ServiceMetrics, max_message_bytes: int, model_name: str):
        self.model_name = model_name
        self.state = state
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self.engine: EngineHandle | None = None  # set by attach() once the model is loaded
        self.static_info = model_info_pb2.ModelInfoResponse()
        self._active_ids: set[str] = set()
        self._suffix = itertools.count(1)

    def attach(self, engine: EngineHandle) -> None:
        self.engine, self.static_info = engine, model_info(engine, self.model_name, self.max_message_bytes)

    @property
    def max_model_len(self) -> int | None:
        return self.static_info.max_context_length if self.engine is not None else None

    def stats(self) -> EngineStats | None:
        """The engine's latest EngineStats, or None while the model loads."""
        return self.engine.stats() if self.engine is not None else None

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        """Handlers take raw bytes: wire.parse_request turns malformed input into INVALID_ARGUMENT."""
        m, name = self.metrics, SERVICE_NAME
        return grpc.method_handlers_generic_handler(name, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                rpc_status.streaming(m, name, "Generate", self.generate),
                response_serializer=pb.GenerateResponse.SerializeToString),
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                rpc_status.unary(m, name, "Tokenize", self.tokenize),
                response_serializer=tokenize_pb2.TokenizeResponse.SerializeToString),
            "ModelInfo": grpc.unary_unary_rpc_method_handler(
                rpc_status.unary(m, name, "ModelInfo", self.model_info),
                response_serializer=model_info_pb2.ModelInfoResponse.SerializeToString),
        })

    # --- RPCs -------------------------------------------------------------------------------------------------

    async def generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        request = parse_request(raw, pb.GenerateRequest, self.max_message_bytes)
        self.state.check_admitting()
        request_id = _request_id(request, context)
        await context.send_initial_metadata(((REQUEST_ID_METADATA, request_id),))
        if input_chars(request) > _LONG_TEXT_CHARS:
            v1 = await asyncio.to_thread(admit, request, self.engine.admit)
        else:
            v1 = admit(request, self.engine.admit)
        prompt = v1.admitted
        builder = FrameBuilder(request_id, len(prompt.prompt_token_ids), prompt.truncated, prompt.params,
                               v1.stream_mode)
        with self.state.track(), self._engine_id(request_id) as engine_id:
            async for event in RequestStream(self.engine, engine_id, prompt, self.metrics, v1.options).events():
                for frame in builder.frames(event):
                    yield frame

    async def tokenize(self, raw: bytes, context: grpc.aio.ServicerContext) -> tokenize_pb2.TokenizeResponse:
        request = parse_request(raw, tokenize_pb2.TokenizeRequest, self.max_message_bytes)
        self.state.check_ready()
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        tokenizer = self.engine.tokenizer
        if not request.return_offsets:
            return tokenize_pb2.TokenizeResponse(token_ids=tokenizer.encode(request.text, add_special))
        ids, offsets = tokenizer.encode_with_offsets(request.text, add_special)
        return tokenize_pb2.TokenizeResponse(token_ids=ids, offsets=utf8_offsets(request.text, offsets))

    async def model_info(self, raw: bytes, context: grpc.aio.ServicerContext) -> model_info_pb2.ModelInfoResponse:
        parse_request(raw, model_info_pb2.ModelInfoRequest, self.max_message_bytes)
        self.state.check_ready()
        info = model_info_pb2.ModelInfoResponse()
        info.CopyFrom(self.static_info)
        s = self.engine.stats()
        info.kv_cache.CopyFrom(model_info_pb2.KvCacheStats(
            total_blocks=s.num_kv_blocks, free_blocks=s.num_free_kv_blocks, used_blocks=s.num_active_kv_blocks,
            usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits))
        info.scheduler.CopyFrom(model_info_pb2.SchedulerStats(
            running_requests=s.num_running, waiting_requests=s.num_waiting, num_preemptions=s.num_preemptions,
            draining=self.state.draining))
        return info

    def _engine_id(self, request_id: str) -> _ActiveId:
        # Retries may reuse x-request-id while the first attempt still runs; the engine needs unique ids.
        engine_id = request_id if request_id not in self._active_ids else f"{request_id}#{next(self._suffix)}"
        return _ActiveId(self._active_ids, engine_id)


class _ActiveId:
    def __init__(self, active: set[str], engine_id: str):
        self.active, self.engine_id = active, engine_id

    def __enter__(self) -> str:
        self.active.add(self.engine_id)
        return self.engine_id

    def __exit__(self, *exc: object) -> None:
        self.active.discard(self.engine_id)


def _request_id(request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> str:
    """The client's id (field first, then metadata), checked before it is echoed; else a fresh one."""
    if request.request_id:
        return check_request_id(request.request_id, "request_id")
    from_metadata = _metadata(context, REQUEST_ID_METADATA)
    if from_metadata is not None:
        return check_request_id(from_metadata, REQUEST_ID_METADATA)
    return uuid.uuid4().hex


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v
    return None


def utf8_offsets(text: str, char_offsets: list[tuple[int, int]]) -> list[tokenize_pb2.Offset]:
    """Character offsets -> UTF-8 byte offsets, the unit every client language can slice by."""
    byte_at = [0]
    for ch in text:
        byte_at.append(byte_at[-1] + len(ch.encode("utf-8")))
    return [tokenize_pb2.Offset(start=byte_at[s], end=byte_at[e]) for s, e in char_offsets]
