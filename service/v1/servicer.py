"""pagedserve.v1 GenerationService: Generate (admitted by requests.py, streamed by service/core/stream.py, framed by
frames.py), Tokenize, ModelInfo, Embed and Rerank (embed.py over service/core/embeddings.py and scores.py)."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator

import grpc
from pagedserve.engine.reasoning import REASONING_FORMATS
from pagedserve.engine.request_id import check_request_id
from pagedserve.engine.requests import AdmittedRequest
from pagedserve.service.core import rpc_status
from pagedserve.service.core.adapters import AdapterAdmin
from pagedserve.service.core.admit import admit_off_loop
from pagedserve.service.core.context import ServingContext
from pagedserve.service.core.embeddings import embed
from pagedserve.service.core.engine_handle import EngineHandle
from pagedserve.service.core.scores import score
from pagedserve.service.core.stream import RequestStream
from pagedserve.service.core.thought_reader import ThoughtReader
from pagedserve.service.core.wire import parse_request
from pagedserve.service.v1.adapter_servicer import adapter_message
from pagedserve.service.v1.embed import (
    embed_response, embedding_requests, rename, rerank_call, rerank_rename, rerank_response,
)
from pagedserve.service.v1.frames import FrameBuilder
from pagedserve.service.v1.model_info import model_info
from pagedserve.service.v1.requests import admit, input_chars
from pagedserve.v1 import embed_pb2, generation_service_pb2, model_info_pb2, tokenize_pb2
from pagedserve.v1 import generate_pb2 as pb

# Importing the generated module also registers the service in the descriptor pool that reflection reads.
SERVICE_NAME = generation_service_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
REQUEST_ID_METADATA = "x-request-id"


class GenerationServicer:
    """serving: the engine, serving state, metrics and model name every front end shares."""

    def __init__(self, serving: ServingContext, max_message_bytes: int):
        self.serving = serving
        self.state, self.metrics = serving.state, serving.metrics
        self.max_message_bytes = max_message_bytes
        self._static_info: model_info_pb2.ModelInfoResponse | None = None  # built on the first ModelInfo
        self._submissions = itertools.count(1)

    @property
    def engine(self) -> EngineHandle | None:
        return self.serving.engine

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
            "Embed": grpc.unary_unary_rpc_method_handler(
                rpc_status.unary(m, name, "Embed", self.embed),
                response_serializer=embed_pb2.EmbedResponse.SerializeToString),
            "Rerank": grpc.unary_unary_rpc_method_handler(
                rpc_status.unary(m, name, "Rerank", self.rerank),
                response_serializer=embed_pb2.RerankResponse.SerializeToString),
        })

    # --- RPCs -------------------------------------------------------------------------------------------------

    async def generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        request = parse_request(raw, pb.GenerateRequest, self.max_message_bytes)
        self.state.check_admitting()
        request_id = _request_id(request, context)
        await context.send_initial_metadata(((REQUEST_ID_METADATA, request_id),))
        v1 = await admit_off_loop(lambda: admit(request, self.engine.admit), input_chars(request),
                                  constrained=request.HasField("constraint"))
        prompt = v1.admitted
        self.metrics.adapter_requests(request.adapter or None)
        builder = FrameBuilder(request_id, len(prompt.prompt_token_ids), prompt.truncated, prompt.params,
                               v1.stream_mode, self._thought_reader(request, prompt))
        # Retries may reuse x-request-id while the first attempt still runs: each submission gets its own engine key,
        # so the engine's one uniqueness check (AsyncEngine) never refuses a v1 request.
        engine_key = f"{request_id}#{next(self._submissions)}"
        with self.state.track():
            origin = self.serving.telemetry.origin("v1", request_id, context.invocation_metadata() or ())
            stream = RequestStream(self.engine, engine_key, prompt, self.serving.telemetry, v1.options, origin)
            async for event in stream.events():
                for frame in builder.frames(event):
                    yield frame

    async def embed(self, raw: bytes, context: grpc.aio.ServicerContext) -> embed_pb2.EmbedResponse:
        request = parse_request(raw, embed_pb2.EmbedRequest, self.max_message_bytes)
        self.state.check_admitting()
        request_id = _request_id(request, context)
        await context.send_initial_metadata(((REQUEST_ID_METADATA, request_id),))
        origin = self.serving.telemetry.origin("v1", request_id, context.invocation_metadata() or ())
        engine_key = f"{request_id}#{next(self._submissions)}"
        embedded = await embed(self.serving, embedding_requests(request), engine_key, origin, rename)
        self.metrics.adapter_requests(request.adapter or None, len(embedded))
        return embed_response(embedded)

    async def rerank(self, raw: bytes, context: grpc.aio.ServicerContext) -> embed_pb2.RerankResponse:
        request = parse_request(raw, embed_pb2.RerankRequest, self.max_message_bytes)
        self.state.check_admitting()
        call = rerank_call(request)
        request_id = _request_id(request, context)
        await context.send_initial_metadata(((REQUEST_ID_METADATA, request_id),))
        origin = self.serving.telemetry.origin("v1", request_id, context.invocation_metadata() or ())
        engine_key = f"{request_id}#{next(self._submissions)}"
        scored = await score(self.serving, call, engine_key, origin, rerank_rename)
        self.metrics.adapter_requests(request.adapter or None, len(call.pairs.texts))
        return rerank_response(scored, request.top_n)

    def _thought_reader(self, request: pb.GenerateRequest, prompt: AdmittedRequest) -> ThoughtReader | None:
        """--reasoning-parser splits chat answers only (as vLLM's chat endpoint): the thought into Delta.reasoning."""
        name = self.engine.describe().reasoning_parser
        if not name or request.WhichOneof("input") != "chat":
            return None
        return ThoughtReader(REASONING_FORMATS.get(name), content_only=bool(prompt.thought_closed))

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
        if self._static_info is None:
            self._static_info = model_info(self.engine, self.serving.model_name, self.max_message_bytes)
        info = model_info_pb2.ModelInfoResponse()
        info.CopyFrom(self._static_info)
        s = self.engine.stats()
        info.kv_cache.CopyFrom(model_info_pb2.KvCacheStats(
            total_blocks=s.num_kv_blocks, free_blocks=s.num_free_kv_blocks, used_blocks=s.num_active_kv_blocks,
            usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits))
        info.scheduler.CopyFrom(model_info_pb2.SchedulerStats(
            running_requests=s.num_running, waiting_requests=s.num_waiting, num_preemptions=s.num_preemptions,
            draining=self.state.draining))
        info.adapters.extend(adapter_message(a) for a in AdapterAdmin(self.serving).adapters())
        return info



def _request_id(request: pb.GenerateRequest | embed_pb2.EmbedRequest | embed_pb2.RerankRequest,
                context: grpc.aio.ServicerContext) -> str:
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
