"""What every request reports, whichever front end it came by: Prometheus metrics always; a span (when tracing is
on) and request log lines (when request logging is on). The front ends hand over their transport's key/value pairs
(gRPC metadata, HTTP headers) once; the W3C trace context is read from them here, and only when something uses it,
so with tracing and request logging off a request costs what it did before either existed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.outputs import CompletionOutput, RequestMetrics
from pagedserve.engine.requests import AdmittedRequest
from pagedserve.service.core.metrics import ServiceMetrics, durations
from pagedserve.service.core.request_log import RequestLog
from pagedserve.service.core.trace_context import TraceContext, trace_context
from pagedserve.service.core.tracing import Attr, RequestTracer

log = logging.getLogger(__name__)
Pairs = Iterable[tuple[str | bytes, str | bytes]]


@dataclass(frozen=True, slots=True)
class RequestOrigin:
    """Who asked: the front end (`v1`, `openai`, `vllm`), the id it answers under, and the caller's trace context."""

    front_end: str
    request_id: str
    trace: TraceContext | None = None


@dataclass(frozen=True, slots=True)
class RequestEnd:
    metrics: RequestMetrics
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str  # the engine's, or "abort" / "time_limit" / "error"
    completions: tuple[CompletionOutput, ...] = ()  # each sample's latest output (its whole text when read)


@dataclass(slots=True)
class Watch:
    """One request's span and ids while it runs (only when tracing or request logging is on)."""

    origin: RequestOrigin
    engine_id: str
    adapter: str | None
    span: Any = None
    trace_id: str | None = None
    span_id: str | None = None


class Telemetry:
    def __init__(self, metrics: ServiceMetrics, model_name: str, tracer: RequestTracer | None = None,
                 request_log: RequestLog | None = None):
        self.metrics, self.model_name = metrics, model_name
        self.tracer, self.request_log = tracer, request_log
        self.reads_context = tracer is not None or request_log is not None

    def origin(self, front_end: str, request_id: str, pairs: Pairs) -> RequestOrigin:
        """The request's origin; its transport pairs are read only when tracing or request logging is on."""
        return RequestOrigin(front_end, request_id, trace_context(pairs) if self.reads_context else None)

    def admitted(self, origin: RequestOrigin | None, engine_id: str, request: AdmittedRequest,
                 arrival: float) -> Watch | None:
        """Starts the span and writes the admission line; a failure here is logged, never the request's."""
        if not self.reads_context or origin is None:
            return None
        try:
            return self._admitted(origin, engine_id, request, arrival)
        except Exception:  # noqa: BLE001 - observability must not fail a request
            log.exception("request telemetry failed at admission")
            return None

    def _admitted(self, origin: RequestOrigin, engine_id: str, request: AdmittedRequest, arrival: float) -> Watch:
        watch = Watch(origin, engine_id, request.adapter.info.name if request.adapter is not None else None)
        if origin.trace is not None:
            watch.trace_id = origin.trace.trace_id
        if self.tracer is not None:
            watch.span = self.tracer.start(origin.trace, arrival, self._request_attributes(watch, request))
            watch.trace_id, watch.span_id = self.tracer.ids(watch.span)
        if self.request_log is not None:
            p = request.params
            self.request_log.write({
                "event": "request_admitted", **self._ids(watch), "prompt_tokens": len(request.prompt_token_ids),
                "max_tokens": p.max_tokens, "n": p.n, **self.request_log.prompt_fields(request.prompt_token_ids)})
        return watch

    def finished(self, watch: Watch | None, end: RequestEnd, engine_answered: bool, engine_failed: bool = False) -> None:
        """Metrics for requests the engine answered at least once, and a finish count for those it failed before
        their first output (as vLLM counts finished_reason="error"; no latencies, which they never had); the span
        and the log line for every admitted one."""
        if engine_answered:
            self.metrics.observe_request(end.metrics, end.prompt_tokens, end.generated_tokens, end.finish_reason)
        elif engine_failed:
            self.metrics.observe_unanswered_failure()
        if watch is None:
            return
        try:
            self._finished(watch, end)
        except Exception:  # noqa: BLE001 - observability must not mask the request's own outcome
            log.exception("request telemetry failed at the end")

    def _finished(self, watch: Watch, end: RequestEnd) -> None:
        d = durations(end.metrics)
        if watch.span is not None:
            self.tracer.finish(watch.span, end.metrics, {
                Attr.USAGE_PROMPT_TOKENS: end.prompt_tokens, Attr.USAGE_COMPLETION_TOKENS: end.generated_tokens,
                Attr.LATENCY_TIME_IN_QUEUE: d.queue_s, Attr.LATENCY_TIME_TO_FIRST_TOKEN: d.time_to_first_token_s,
                Attr.LATENCY_E2E: d.total_s, Attr.LATENCY_TIME_IN_MODEL_PREFILL: d.prefill_s,
                Attr.LATENCY_TIME_IN_MODEL_DECODE: d.decode_s, Attr.LATENCY_TIME_IN_MODEL_INFERENCE: d.inference_s,
                Attr.FINISH_REASON: end.finish_reason, Attr.NUM_PREEMPTIONS: end.metrics.num_preemptions,
                Attr.NUM_CACHED_TOKENS: end.metrics.num_cached_tokens}, failed=end.finish_reason == "error")
        if self.request_log is not None:
            self.request_log.write({
                "event": "request_finished", **self._ids(watch), "prompt_tokens": end.prompt_tokens,
                "output_tokens": end.generated_tokens, "finish_reason": end.finish_reason,
                "queue_s": round(d.queue_s, 6), "ttft_s": round(d.time_to_first_token_s, 6),
                "prefill_s": round(d.prefill_s, 6), "decode_s": round(d.decode_s, 6), "e2e_s": round(d.total_s, 6),
                "num_preemptions": end.metrics.num_preemptions, "cached_tokens": end.metrics.num_cached_tokens,
                **self.request_log.output_fields(end.completions)})

    def shutdown(self) -> None:
        if self.tracer is not None:
            self.tracer.shutdown()

    def _ids(self, watch: Watch) -> dict[str, Any]:
        o = watch.origin
        return {"request_id": o.request_id, "engine_request_id": watch.engine_id, "trace_id": watch.trace_id,
                "span_id": watch.span_id, "front_end": o.front_end, "model": self.model_name, "adapter": watch.adapter}

    def _request_attributes(self, watch: Watch, request: AdmittedRequest) -> dict[str, Any]:
        p, origin = request.params, watch.origin
        attributes = {Attr.RESPONSE_MODEL: watch.adapter or self.model_name, Attr.REQUEST_ID: origin.request_id,
                      Attr.REQUEST_TEMPERATURE: float(p.temperature), Attr.REQUEST_TOP_P: float(p.top_p),
                      Attr.REQUEST_N: p.n, Attr.USAGE_NUM_SEQUENCES: p.n, Attr.FRONT_END: origin.front_end}
        if p.max_tokens is not None:
            attributes[Attr.REQUEST_MAX_TOKENS] = p.max_tokens
        if watch.adapter:
            attributes[Attr.ADAPTER] = watch.adapter
        return attributes
