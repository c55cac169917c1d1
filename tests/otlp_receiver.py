"""A real OTLP trace receiver on loopback: a grpc server serving opentelemetry.proto.collector.trace.v1.TraceService
from the official protobuf definitions (PyPI opentelemetry-proto), and OTLP/HTTP's POST /v1/traces of the same
message. No OpenTelemetry Collector is packaged for PyPI or Debian here; this receives exactly what an exporter
sends one, over the same wire protocols."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

SPAN_KIND_SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: int
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: dict[str, int]  # name -> time (Unix ns)
    status_code: int


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else str(v)


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self.server: grpc.Server | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext):  # noqa: N802
        self.record(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def record(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    received.append(ReceivedSpan(
                        str(resource.get("service.name", "")), s.name, s.kind, s.trace_id.hex(), s.span_id.hex(),
                        s.parent_span_id.hex(), s.start_time_unix_nano, s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes},
                        {e.name: e.time_unix_nano for e in s.events}, s.status.code))
        with self._changed:
            self.spans.extend(received)
            self._changed.notify_all()

    def wait_for(self, match: Callable[[ReceivedSpan], bool], timeout: float = 60.0) -> ReceivedSpan:
        """The first received span that matches; the timeout only bounds a hang (spans leave in ~1 s batches)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [s for s in self.spans if match(s)]
                if found:
                    return found[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    names = [(s.service, s.name, s.attributes.get("gen_ai.request.id")) for s in self.spans]
                    raise AssertionError(f"no matching span after {timeout}s; received: {names}")
                self._changed.wait(left)

    def in_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._changed:
            return [s for s in self.spans if s.trace_id == trace_id]


def start_receiver() -> TraceReceiver:
    receiver = TraceReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    receiver.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    receiver.server = server
    return receiver


def start_http_receiver(receiver: TraceReceiver) -> ThreadingHTTPServer:
    """OTLP/HTTP (binary protobuf) into the same receiver; the URL is http://127.0.0.1:PORT/v1/traces."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            ok = self.path == "/v1/traces" and self.headers.get("content-type") == "application/x-protobuf"
            if ok:
                receiver.record(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString() if ok else b""
            self.send_response(200 if ok else 400)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
