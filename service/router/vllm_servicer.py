"""vllm.grpc.engine.VllmEngine (smg-grpc-proto): the worker protocol SMG, vllm-router and llm-d route to.

A thin adapter beside pagedserve.v1 on the same server and engine: request mapping lives in vllm_requests.py,
status codes in service/core/errors.py, replies are built from the stream's events (service/core/stream.py) here.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import grpc
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.request_id import check_request_id
from pagedserve.engine.requests import EmbeddingRequest, TokensPrompt
from pagedserve.service.core import rpc_status
from pagedserve.service.core.admit import admit_off_loop
from pagedserve.service.core.context import ServingContext
from pagedserve.service.core.embeddings import embed
from pagedserve.service.core.engine_handle import EngineHandle
from pagedserve.service.core.stream import Ended, RequestStream
from pagedserve.service.core.wire import parse_request
from pagedserve.service.router.kv_events import KvEventHub
from pagedserve.service.router.tokenizer_bundle import TokenizerBundle, bundle
from pagedserve.service.router.vllm_replies import chunk, complete, kv_batch
from pagedserve.service.router.vllm_requests import admit, constrained_decoding_start, input_chars
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

SERVICE_NAME = "vllm.grpc.engine.VllmEngine"
_VERSION = f"pagedserve {importlib.metadata.version('pagedserve')}"
_UNIMPLEMENTED = {
    "StartProfile": "profiling is not supported",
    "StopProfile": "profiling is not supported",
}


class VllmEngineServicer:
    """serving: the engine, serving state, metrics and model name every front end shares."""

    def __init__(self, serving: ServingContext, max_message_bytes: int, max_pending_kv_batches: int = 1024):
        self.serving = serving
        self.state, self.metrics, self.model_name = serving.state, serving.metrics, serving.model_name
        self.max_message_bytes = max_message_bytes
        self.kv_events = KvEventHub(max_pending_kv_batches)
        self._started = time.time()
        self._last_receive = 0.0
        self._tokenizer: TokenizerBundle | None = None  # built on the first GetTokenizer

    @property
    def engine(self) -> EngineHandle | None:
        return self.serving.engine

    def listen(self, engine: EngineHandle) -> None:
        """Once the model is loaded: the engine's prefix-cache events feed SubscribeKvEvents."""
        engine.publish_kv_events(self.kv_events.publish)

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        m, name = self.metrics, SERVICE_NAME

        def unary(method: str, impl: Any, reply: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                rpc_status.unary(m, name, method, impl), response_serializer=reply.SerializeToString)

        def stream(method: str, impl: Any, reply: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_stream_rpc_method_handler(
                rpc_status.streaming(m, name, method, impl), response_serializer=reply.SerializeToString)

        handlers = {
            "Generate": stream("Generate", self.generate, vpb.GenerateResponse),
            "SubscribeKvEvents": stream("SubscribeKvEvents", self.subscribe_kv_events, common_pb2.KvEventBatch),
            "Embed": unary("Embed", self.embed, vpb.EmbedResponse),
            "Abort": unary("Abort", self.abort, vpb.AbortResponse),
            "HealthCheck": unary("HealthCheck", self.health_check, vpb.HealthCheckResponse),
            "GetModelInfo": unary("GetModelInfo", self.get_model_info, vpb.GetModelInfoResponse),
            "GetServerInfo": unary("GetServerInfo", self.get_server_info, vpb.GetServerInfoResponse),
            "GetLoads": unary("GetLoads", self.get_loads, vpb.GetLoadsResponse),
            "FlushCache": unary("FlushCache", self.flush_cache, common_pb2.FlushCacheResponse),
            "GetTokenizer": stream("GetTokenizer", self.get_tokenizer, common_pb2.GetTokenizerChunk),
        }
        for method, why in _UNIMPLEMENTED.items():
            handlers[method] = _unimplemented(method, why)
        missing = set(vpb.DESCRIPTOR.services_by_name["VllmEngine"].methods_by_name) - set(handlers)
        if missing:  # a newer smg-grpc-proto than the pinned one: answer every RPC, never fall through
            raise RuntimeError(f"VllmEngine RPCs without a handler: {sorted(missing)}")
        return grpc.method_handlers_generic_handler(name, handlers)

    # --- RPCs -------------------------------------------------------------------------------------------------

    async def generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[vpb.GenerateResponse]:
        request = parse_request(raw, vpb.GenerateRequest, self.max_message_bytes)
        self.state.check_admitting()
        self._last_receive = time.time()
        request_id = check_request_id(request.request_id, "request_id") if request.request_id else uuid.uuid4().hex
        admitted = await admit_off_loop(lambda: admit(request, self.engine.admit), input_chars(request),
                                        constrained=_constrained(request))
        # The engine keys the request by the router's id, so Abort finds it from any connection; a second
        # request under an id still in flight is refused (INVALID_ARGUMENT), as vLLM refuses it.
        completed: set[int] = set()  # an engine output lists every sample, those finished in earlier steps too
        with self.state.track():
            origin = self.serving.telemetry.origin("vllm", request_id, context.invocation_metadata() or ())
            stream = RequestStream(self.engine, request_id, admitted, self.serving.telemetry, origin=origin)
            async for event in stream.events():
                if not isinstance(event, Ended):
                    for reply in _replies(event, request.stream, completed):
                        yield reply

    async def embed(self, raw: bytes, context: grpc.aio.ServicerContext) -> vpb.EmbedResponse:
        """One pre-tokenized input's vector (an embedding model's server: GetModelInfo.is_generation false)."""
        request = parse_request(raw, vpb.EmbedRequest, self.max_message_bytes)
        self.state.check_admitting()
        self._last_receive = time.time()
        request_id = check_request_id(request.request_id, "request_id") if request.request_id else uuid.uuid4().hex
        prompt = TokensPrompt(tuple(request.tokenized.input_ids))
        origin = self.serving.telemetry.origin("vllm", request_id, context.invocation_metadata() or ())
        (embedded,) = await embed(self.serving, [EmbeddingRequest(prompt)], request_id, origin, _embed_field)
        return vpb.EmbedResponse(embedding=embedded.vector, prompt_tokens=embedded.prompt_tokens,
                                 embedding_dim=len(embedded.vector))

    async def abort(self, raw: bytes, context: grpc.aio.ServicerContext) -> vpb.AbortResponse:
        """Aborts by router request id whichever connection started it; the stream ends with finish 'abort'."""
        request = parse_request(raw, vpb.AbortRequest, self.max_message_bytes)
        self.state.check_ready()
        for request_id in request.request_ids:
            await self.engine.abort(request_id)  # an id not in flight (already finished) is a no-op
        return vpb.AbortResponse()

    async def subscribe_kv_events(self, raw: bytes, context: grpc.aio.ServicerContext
                                  ) -> AsyncIterator[common_pb2.KvEventBatch]:
        parse_request(raw, common_pb2.SubscribeKvEventsRequest, self.max_message_bytes)
        self.state.check_ready()
        # No history is kept: every subscription (a resume included) starts with a snapshot of the live blocks.
        subscription = self.kv_events.subscribe()
        try:
            while True:
                yield kv_batch(await subscription.next())
        finally:
            subscription.close()

    async def get_tokenizer(self, raw: bytes, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        """The model folder's tokenizer files as a zip; the fingerprint rides on the last chunk."""
        parse_request(raw, common_pb2.GetTokenizerRequest, self.max_message_bytes)
        self.state.check_ready()
        if self._tokenizer is None:
            folder = Path(self.engine.describe().tokenizer_path)
            self._tokenizer = await asyncio.to_thread(bundle, folder)
        chunks = self._tokenizer.chunks()
        for i, data in enumerate(chunks):
            last = i == len(chunks) - 1
            yield common_pb2.GetTokenizerChunk(data=data, sha256=self._tokenizer.sha256 if last else "")

    async def flush_cache(self, raw: bytes, context: grpc.aio.ServicerContext) -> common_pb2.FlushCacheResponse:
        """Invalidates the prefix cache between engine steps; running requests keep their blocks."""
        parse_request(raw, common_pb2.FlushCacheRequest, self.max_message_bytes)
        self.state.check_ready()
        dropped = await self.engine.reset_prefix_cache()
        return common_pb2.FlushCacheResponse(success=True, message=f"{dropped} cached blocks invalidated")

    async def health_check(self, raw: bytes, context: grpc.aio.ServicerContext) -> vpb.HealthCheckResponse:
        parse_request(raw, vpb.HealthCheckRequest, self.max_message_bytes)
        if not self.state.ready:
            return vpb.HealthCheckResponse(healthy=False, message="model is loading")
        if self.state.draining:
            return vpb.HealthCheckResponse(healthy=False, message="draining for shutdown")
        if self.engine.dead_reason is not None:
            return vpb.HealthCheckResponse(healthy=False, message=self.engine.dead_reason)
        return vpb.HealthCheckResponse(healthy=True, message="serving")

    async def get_model_info(self, raw: bytes, context: grpc.aio.ServicerContext) -> vpb.GetModelInfoResponse:
        parse_request(raw, vpb.GetModelInfoRequest, self.max_message_bytes)
        self.state.check_ready()
        model = self.engine.describe()
        hf, generates = self.engine.tokenizer.hf, model.runner == "generate"
        return vpb.GetModelInfoResponse(
            model_path=model.model_path, is_generation=generates, max_context_length=model.max_model_len,
            vocab_size=model.vocab_size, supports_vision=False, served_model_name=self.model_name,
            tokenizer_path=model.tokenizer_path, model_type=model.model_type, architectures=[model.architecture],
            eos_token_ids=sorted(model.eos_token_ids), pad_token_id=_token_id(hf.pad_token_id),
            bos_token_id=_token_id(hf.bos_token_id), max_req_input_len=model.max_model_len - generates,
            default_sampling_params_json="{}")

    async def get_server_info(self, raw: bytes, context: grpc.aio.ServicerContext) -> vpb.GetServerInfoResponse:
        parse_request(raw, vpb.GetServerInfoRequest, self.max_message_bytes)
        self.state.check_ready()
        model, config = self.engine.describe(), self.engine.config
        # server_type names the protocol the router speaks to this worker, not the engine behind it.
        return vpb.GetServerInfoResponse(
            active_requests=self.engine.num_unfinished, is_paused=self.state.draining,
            last_receive_timestamp=self._last_receive, uptime_seconds=time.time() - self._started,
            server_type="vllm-grpc", data_parallel_size=1, kv_cache_dtype=model.kv_cache_dtype,
            block_size=model.block_size, attention_backend=config.attention_backend, model_dtype=model.dtype,
            max_num_seqs=config.max_num_seqs, engine_reasoning_parser=model.reasoning_parser,
            constrained_decoding_start=constrained_decoding_start(model.reasoning_parser,
                                                                  config.constraints_in_reasoning))

    async def get_loads(self, raw: bytes, context: grpc.aio.ServicerContext) -> vpb.GetLoadsResponse:
        """The numbers behind the Prometheus gauges (vllm:num_requests_*, vllm:kv_cache_usage_perc)."""
        request = parse_request(raw, vpb.GetLoadsRequest, self.max_message_bytes)
        self.state.check_ready()
        s = self.engine.stats()
        load = vpb.SchedulerLoad(
            dp_rank=0, num_running_reqs=s.num_running, num_waiting_reqs=s.num_waiting,
            num_total_reqs=s.num_running + s.num_waiting, num_used_tokens=s.num_active_kv_blocks * s.block_size,
            max_total_num_tokens=s.num_kv_blocks * s.block_size, token_usage=s.kv_cache_usage,
            cache_hit_rate=s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
            max_running_requests=self.engine.config.max_num_seqs)
        loads = [] if request.HasField("dp_rank") and request.dp_rank != 0 else [load]
        return vpb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version=_VERSION,
                                    dp_rank_count=1, loads=loads)


def _replies(out: RequestOutput, stream: bool, completed: set[int]) -> list[vpb.GenerateResponse]:
    """Streaming: a chunk per new-token delta, then a Complete (no tokens) per finished index.
    Non-streaming: one Complete per index with all its tokens. `completed`: the indices already sent their
    Complete (samples of one request can finish in different steps: each gets exactly one)."""
    replies = []
    for completion in out.outputs:
        if stream and completion.new_token_ids:
            replies.append(vpb.GenerateResponse(chunk=chunk(out, completion)))
        if completion.finished and completion.index not in completed:
            completed.add(completion.index)
            replies.append(vpb.GenerateResponse(complete=complete(out, completion, with_tokens=not stream)))
    return replies


def _unimplemented(method: str, why: str) -> grpc.RpcMethodHandler:
    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{SERVICE_NAME}/{method}: {why}")

    return grpc.unary_unary_rpc_method_handler(handler)


def _embed_field(index: int, field: str) -> str:
    return "tokenized.input_ids" + field.removeprefix("prompt_token_ids") if field.startswith("prompt_token_ids") \
        else field


def _token_id(value: int | None) -> int:
    return -1 if value is None else int(value)



def _constrained(request: vpb.GenerateRequest) -> bool:
    """Whether admission will compile a constraint (then it runs in a worker thread, off the event loop)."""
    return request.HasField("sampling_params") and request.sampling_params.WhichOneof("constraint") is not None
