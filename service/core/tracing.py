"""OpenTelemetry spans of requests, exported over OTLP (`--otlp-traces-endpoint`, vLLM's flag).

One span per engine request, named and attributed as vLLM's (`llm_request`, kind SERVER, `gen_ai.*` attribute
names from vllm/tracing.py), the child of the caller's `traceparent` when one came with the request. It starts at
admission and ends when the request does; its queue, prefill and decode phases are attributes and events at the
engine's own timestamps. OpenTelemetry is the optional `otel` extra: it is imported only when tracing is on, so a
server without it starts, and one asked to trace without it refuses to start, naming the extra.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.errors import ConfigError
from pagedserve.engine.outputs import RequestMetrics
from pagedserve.service.core.trace_context import TraceContext

PROTOCOLS = ("grpc", "http/protobuf")
SPAN_NAME = "llm_request"
_EXPORTERS = {"grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
              "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter"}
_OWN = "pagedserve."  # the namespace of pagedserve's own span attributes
_EXPORT_DELAY_MS = 1000  # spans leave in batches at least this often (the SDK's default is 5 s)


class Attr:
    """vLLM's span attribute names (vllm/tracing.py SpanAttributes), so its dashboards and queries apply."""

    RESPONSE_MODEL = "gen_ai.response.model"
    REQUEST_ID = "gen_ai.request.id"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_N = "gen_ai.request.n"
    USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # pagedserve's own, under its name (vLLM has none for these)
    FRONT_END = _OWN + "front_end"
    FINISH_REASON = _OWN + "finish_reason"
    ADAPTER = _OWN + "lora_adapter"
    NUM_PREEMPTIONS = _OWN + "num_preemptions"
    NUM_CACHED_TOKENS = _OWN + "num_cached_tokens"


@dataclass(frozen=True, slots=True)
class TracingConfig:
    endpoint: str  # host:port, or http(s)://host:port (grpc) / http(s)://host:port/v1/traces (http/protobuf)
    protocol: str = "grpc"
    service_name: str = "pagedserve"

    def __post_init__(self) -> None:
        if not self.endpoint.strip():
            raise ConfigError("otlp_traces_endpoint", "must not be empty")
        if self.protocol not in PROTOCOLS:
            raise ConfigError("otlp_traces_protocol", f"unknown protocol {self.protocol!r}; supported: "
                              f"{', '.join(PROTOCOLS)}")


def wall_ns(monotonic_s: float, now_wall: float, now_monotonic: float) -> int:
    """An engine timestamp (time.monotonic()) as Unix nanoseconds, the clock spans carry."""
    return int((now_wall - now_monotonic + monotonic_s) * 1e9)


class RequestTracer:
    """Owns a TracerProvider with a batching OTLP exporter; spans are built on the event loop, exported on the
    SDK's worker thread."""

    def __init__(self, config: TracingConfig):
        otel = _import_otel(config.protocol)
        exporter_module, sdk_trace, export, resources, trace, propagate = otel
        self._trace, self._propagator = trace, propagate.TraceContextTextMapPropagator()
        resource = resources.Resource.create({"service.name": config.service_name})
        self.provider = sdk_trace.TracerProvider(resource=resource)
        exporter = exporter_module.OTLPSpanExporter(endpoint=_endpoint(config))
        self.provider.add_span_processor(export.BatchSpanProcessor(exporter, schedule_delay_millis=_EXPORT_DELAY_MS))
        self.tracer = self.provider.get_tracer("pagedserve.service")

    def start(self, parent: TraceContext | None, arrival_monotonic: float, attributes: dict[str, Any]) -> Any:
        context = self._propagator.extract(parent.headers()) if parent is not None else None
        start = wall_ns(arrival_monotonic, time.time(), time.monotonic())
        return self.tracer.start_span(SPAN_NAME, context=context, kind=self._trace.SpanKind.SERVER,
                                      attributes=attributes, start_time=start)

    @staticmethod
    def ids(span: Any) -> tuple[str, str]:
        """(trace id, span id) as hex, for log lines."""
        ctx = span.get_span_context()
        return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"

    def finish(self, span: Any, metrics: RequestMetrics, attributes: dict[str, Any], failed: bool) -> None:
        now_wall, now_mono = time.time(), time.monotonic()
        for name, at in (("first_scheduled", metrics.first_scheduled_time), ("first_token", metrics.first_token_time)):
            if at is not None:
                span.add_event(name, timestamp=wall_ns(at, now_wall, now_mono))
        span.set_attributes(attributes)
        if failed:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR))
        end = metrics.finished_time if metrics.finished_time is not None else now_mono
        span.end(end_time=wall_ns(end, now_wall, now_mono))

    def shutdown(self) -> None:
        """Exports what is still batched (bounded by the exporter's own timeout)."""
        self.provider.shutdown()


def _endpoint(config: TracingConfig) -> str:
    """host:port alone means plaintext (as SMG's flag takes it; the gRPC exporter would otherwise try TLS);
    https:// asks for TLS. OTLP/HTTP gets its /v1/traces path when only host:port is given."""
    endpoint = config.endpoint.strip()
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    if config.protocol == "http/protobuf" and endpoint.rstrip("/").count("/") == 2:
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return endpoint


def _import_otel(protocol: str) -> tuple[Any, ...]:
    try:
        return tuple(importlib.import_module(name) for name in (
            _EXPORTERS[protocol], "opentelemetry.sdk.trace", "opentelemetry.sdk.trace.export",
            "opentelemetry.sdk.resources", "opentelemetry.trace", "opentelemetry.trace.propagation.tracecontext"))
    except ImportError as exc:
        raise ConfigError("otlp_traces_endpoint", f"tracing needs OpenTelemetry, which is not installed ({exc}); "
                          "install the otel extra: pip install 'pagedserve[otel]'") from None
