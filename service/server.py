"""The grpc.aio server: health, reflection, TLS, metrics, and the SIGTERM drain."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import ConfigError
from pagedserve.engine.host.allocator import release_freed_memory
from pagedserve.engine.host.main_thread import MainThreadHost
from pagedserve.engine.host.tuning import tune_host
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.loading.model_store import default_served_name, model_folder
from pagedserve.service.config import ObservabilityConfig, ServerConfig, TlsConfig
from pagedserve.service.core.context import ServingContext
from pagedserve.service.core.engine_handle import load_engine
from pagedserve.service.core.http_endpoints import serve_http
from pagedserve.service.core.lifecycle import ServingState
from pagedserve.service.core.metrics import ServiceMetrics
from pagedserve.service.core.request_log import RequestLog, RequestLogConfig, StatsLog
from pagedserve.service.core.standard_services import (
    HEALTH_SERVICE, REFLECTION_SERVICES, health_rpc_handler, reflection_rpc_handlers,
)
from pagedserve.service.core.auth import ApiKey, GrpcApiKeyInterceptor
from pagedserve.service.core.telemetry import Telemetry
from pagedserve.service.core.tracing import RequestTracer, TracingConfig
from pagedserve.service.openai.http_server import HttpServer
from pagedserve.service.openai.openai_tools import ToolSettings
from pagedserve.service.router.vllm_servicer import SERVICE_NAME as VLLM_SERVICE_NAME, VllmEngineServicer
from pagedserve.service.v1.adapter_servicer import SERVICE_NAME as ADAPTER_SERVICE_NAME, AdapterServicer
from pagedserve.service.v1.servicer import SERVICE_NAME, GenerationServicer

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVICE_NAMES = (SERVICE_NAME, ADAPTER_SERVICE_NAME, HEALTH_SERVICE, *REFLECTION_SERVICES)


async def serve(engine_config: EngineConfig, config: ServerConfig, host: MainThreadHost | None = None) -> int:
    """Runs until SIGTERM/SIGINT, then drains; returns the process exit code.

    host: the main thread's MainThreadHost when this event loop runs on a side thread (the CLI's layout); the
    engine then computes on the main thread and signals arrive through the host.
    """
    stop = _StopSignals(host)
    health = HealthServicer()
    state = ServingState(health, services=(SERVICE_NAME, ADAPTER_SERVICE_NAME))
    name = config.served_model_name or default_served_name(engine_config.model)
    metrics = ServiceMetrics(name, lambda: serving.stats())
    observability = config.observability or ObservabilityConfig()
    serving = ServingContext(state, metrics, name, _telemetry(metrics, name, observability, lambda: serving),
                             config.served_model_aliases)
    stats_log = _stats_log(observability, serving)
    servicer = GenerationServicer(serving, config.max_message_bytes)
    interceptors = [GrpcApiKeyInterceptor(ApiKey(config.api_key))] if config.api_key else []
    server = grpc.aio.server(options=config.grpc_options(), interceptors=interceptors)
    adapters = AdapterServicer(serving, config.max_message_bytes)
    server.add_generic_rpc_handlers((servicer.rpc_handler(), adapters.rpc_handler()))
    vllm = VllmEngineServicer(serving, config.max_message_bytes) if config.vllm_engine_service else None
    if vllm is not None:
        server.add_generic_rpc_handlers((vllm.rpc_handler(),))
    server.add_generic_rpc_handlers((health_rpc_handler(health, config.max_message_bytes),))
    server.add_generic_rpc_handlers(reflection_rpc_handlers(SERVICE_NAMES + ((VLLM_SERVICE_NAME,) if vllm else ())))
    await state.set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
    http = _http_server(serving, config, model_folder(engine_config.model, engine_config.hub))  # binds first: a taken port stops the start before anything runs
    port = _bind(server, config)
    await server.start()
    metrics_port = _serve_metrics(metrics, state, config)
    if http is not None:
        await http.start()  # up before the model loads, so /health answers 503 meanwhile
    # Says which port speaks what: a vLLM launch line's --port is its HTTP port, here it is gRPC's.
    log.info("gRPC on %s:%d (%s), metrics port %s, %s; loading model", config.host, port,
             "mTLS" if config.tls and config.tls.mutual else "TLS" if config.tls else "plaintext", metrics_port,
             f"OpenAI HTTP on port {http.port}" if http else "OpenAI HTTP off (--http-port PORT serves it)")
    try:
        # The host tuning runs where the engine is built and will compute (the main thread, through the host).
        build = lambda: _built(LLMEngine(engine_config, governor=tune_host(engine_config)))  # noqa: E731
        engine = await stop.race(load_engine(engine_config, build, host))
    except BaseException:
        await server.stop(grace=None)  # a failed load must not leave the listener to the garbage collector
        if http is not None:
            await http.stop()
        raise
    if engine is not None:
        serving.attach(engine)
        if vllm is not None:
            vllm.listen(engine)
        await state.mark_serving()
        if stats_log is not None:
            stats_log.start()
        _write_ready_file(config.ready_file, port, metrics_port, http.port if http else None)
        log.info("serving %s", serving.model_name)
        await stop.first.wait()
    await drain(server, state, config, stop)
    if http is not None:
        await http.stop()
    if stats_log is not None:
        await stats_log.stop()
    if engine is not None:
        await engine.shutdown()
    await asyncio.to_thread(serving.telemetry.shutdown)  # exports the spans still batched
    log.info("stopped")
    return 0


async def drain(server: grpc.aio.Server, state: ServingState, config: ServerConfig, stop: _StopSignals) -> None:
    """Readiness fails at once; requests are still admitted for `drain_delay_s` (load balancers and endpoint
    lists take a few seconds to stop routing here); then UNAVAILABLE for new requests while in-flight streams
    get `shutdown_grace_s` to finish. The engine keeps stepping at full speed throughout: nothing here polls."""
    await state.mark_unready()
    if config.drain_delay_s > 0 and state.ready:
        log.info("shutting down: NOT_SERVING, still admitting for %.1fs", config.drain_delay_s)
        await _until(asyncio.sleep(config.drain_delay_s), stop.second.wait())
    log.info("draining: %d request(s) in flight, grace %.1fs", state.in_flight, config.shutdown_grace_s)
    await state.start_draining()
    finished = await _until(state.wait_idle(config.shutdown_grace_s), stop.second.wait())
    if not finished:  # grace over, or a second signal skipped it
        log.warning("grace period over: cancelling %d request(s)", state.in_flight)
    await server.stop(grace=0.5)


async def _until(work: Coroutine[Any, Any, T], cut: Coroutine[Any, Any, Any]) -> T | None:
    """work's result, or None when `cut` finishes first (a second SIGTERM cuts every wait short)."""
    task, cutter = asyncio.ensure_future(work), asyncio.ensure_future(cut)
    await asyncio.wait({task, cutter}, return_when=asyncio.FIRST_COMPLETED)
    cutter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


def _built(engine: LLMEngine) -> LLMEngine:
    release_freed_memory()  # what loading freed, kept by the allocator's thresholds otherwise (engine/host/allocator.py)
    return engine


def _bind(server: grpc.aio.Server, config: ServerConfig) -> int:
    host = f"[{config.host}]" if ":" in config.host else config.host
    address = f"{host}:{config.port}"
    if config.tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(config.tls))


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    pair = (Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=tls.mutual)


def _serve_metrics(metrics: ServiceMetrics, state: ServingState, config: ServerConfig) -> int | None:
    if config.metrics_port is None:
        return None
    ready = lambda: state.accepting_traffic  # noqa: E731 - read on the HTTP thread; a bool read is atomic
    return serve_http(metrics.registry, ready, config.metrics_host or config.host, config.metrics_port)


def _http_server(serving: ServingContext, config: ServerConfig, folder: Path | None) -> HttpServer | None:
    """The OpenAI API on this event loop (--http-port), sharing the serving context's engine, state and metrics."""
    if config.http_port is None:
        return None
    try:
        tools = ToolSettings(config.enable_auto_tool_choice, config.tool_call_parser)
        key = ApiKey(config.api_key) if config.api_key else None
        policy = config.request_policy(folder)
        return HttpServer(serving, config.host, config.http_port, config.max_message_bytes, config.tls, tools, key,
                          policy, config.cors, config.root_path, config.request_id_headers)
    except OSError as exc:
        raise ConfigError("http_port", f"cannot listen on {config.host}:{config.http_port}: {exc}") from None


def _telemetry(metrics: ServiceMetrics, name: str, config: ObservabilityConfig, serving) -> Telemetry:  # noqa: ANN001
    """Tracing and request logs as configured; OpenTelemetry is imported only when tracing is on (a missing
    extra stops the start here, before the model loads). `serving()`: the context, for the tokenizer, which
    decodes a logged prompt."""
    tracer = None
    if config.otlp_traces_endpoint is not None:
        tracer = RequestTracer(TracingConfig(config.otlp_traces_endpoint, config.otlp_traces_protocol,
                                             config.service_name))
        log.info("tracing: OTLP (%s) to %s", config.otlp_traces_protocol, config.otlp_traces_endpoint)
    request_log = None
    if config.log_requests:
        decode = lambda ids: serving().engine.tokenizer.decode(ids)  # noqa: E731 - only with --log-prompts
        request_log = RequestLog(RequestLogConfig(config.log_prompts, config.max_log_len, config.log_outputs),
                                 decode if config.log_prompts else None)
    return Telemetry(metrics, name, tracer, request_log)


def _stats_log(config: ObservabilityConfig, serving: ServingContext) -> StatsLog | None:
    if config.stats_interval_s <= 0:
        return None
    metrics = serving.metrics
    return StatsLog(config.stats_interval_s, serving.stats,
                    lambda: (metrics.step_prompt_tokens, metrics.step_generation_tokens))


def _write_ready_file(path: Path | None, port: int, metrics_port: int | None, http_port: int | None) -> None:
    """Atomic, so a watcher never reads half a file."""
    if path is None:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"port": port, "metrics_port": metrics_port, "http_port": http_port,
                               "pid": os.getpid()}))
    tmp.replace(path)


class _StopSignals:
    """SIGTERM/SIGINT: the first starts the drain, a second one cuts the grace period short."""

    def __init__(self, host: MainThreadHost | None) -> None:
        self.first, self.second = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        if host is not None:  # the main thread owns signal handlers and relays them here
            host.relay_signals_to(lambda _signum: self._from_main_thread(loop))
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)

    def _from_main_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.call_soon_threadsafe(self._on_signal)
        except RuntimeError:
            pass  # the loop already closed: the server has stopped

    def _on_signal(self) -> None:
        (self.second if self.first.is_set() else self.first).set()

    async def race(self, coro):  # noqa: ANN001, ANN201 - returns the coroutine's result, or None when stopped first
        task, stopped = asyncio.ensure_future(coro), asyncio.ensure_future(self.first.wait())
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if task.done():
            return task.result()
        task.cancel()
        return None
