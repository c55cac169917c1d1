"""The observability flags of `pagedserve serve`, with vLLM's names where vLLM has the feature: tracing
(`--otlp-traces-endpoint`), request logs (`--enable-log-requests`, and `--disable-log-requests` with its meaning,
`--enable-log-outputs`),
the stats line (`--disable-log-stats`, `--stats-interval`) and `--max-log-len`."""

from __future__ import annotations

import argparse
import os

from pagedserve.service.config import ObservabilityConfig

# OpenTelemetry's standard variables, read when the flags leave them open (as vLLM reads the protocol one).
_PROTOCOL_ENV, _SERVICE_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME"


def add_observability_flags(parser: argparse.ArgumentParser) -> None:
    d = ObservabilityConfig()
    g = parser.add_argument_group("observability")
    g.add_argument("--otlp-traces-endpoint",
                   help="export a span per request over OTLP to this collector (host:port is plaintext gRPC; "
                        "http:// or https:// URLs too); needs the otel extra (default: off)")
    g.add_argument("--otlp-traces-protocol", choices=["grpc", "http/protobuf"],
                   help=f"OTLP transport (default: ${_PROTOCOL_ENV}, else grpc)")
    g.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=d.log_requests,
                   help="log one JSON line per request at admission and at finish: ids, trace id, sizes, timings, "
                        "finish reason (never the prompt unless --log-prompts)")
    g.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                   help="no per-request lines (the default; vLLM's flag, accepted with its meaning)")
    g.add_argument("--log-prompts", action="store_true", default=d.log_prompts,
                   help="request lines also carry the prompt's token ids and text (off: never logged)")
    g.add_argument("--enable-log-outputs", dest="log_outputs", action="store_true", default=d.log_outputs,
                   help="the finish line also carries each sample's generated text and token ids (vLLM's; off: "
                        "never logged)")
    g.add_argument("--max-log-len", type=int, help="prompt and output tokens (and characters) a request line "
                   "carries at most")
    g.add_argument("--stats-interval", type=float, default=d.stats_interval_s,
                   help="seconds between stats lines: throughput, running/waiting, KV usage (0: off; "
                        f"default {d.stats_interval_s:g})")
    g.add_argument("--disable-log-stats", action="store_true", help="no stats line (vLLM's flag)")


def observability_config(args: argparse.Namespace) -> ObservabilityConfig:
    return ObservabilityConfig(
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        otlp_traces_protocol=args.otlp_traces_protocol or os.environ.get(_PROTOCOL_ENV, "grpc"),
        service_name=os.environ.get(_SERVICE_ENV, "pagedserve"), log_requests=args.log_requests,
        log_prompts=args.log_prompts, log_outputs=args.log_outputs, max_log_len=args.max_log_len,
        stats_interval_s=0.0 if args.disable_log_stats else args.stats_interval)
