"""Server (transport) configuration; the engine's own settings live in pagedserve.engine.EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.engine.errors import ConfigError
from pagedserve.service.core.auth import ApiKey
from pagedserve.service.core.request_policy import RequestPolicy, generation_defaults

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None  # set: mutual TLS, clients must present a certificate signed by this CA

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "client_ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"tls.{name}", f"file not found: {path}")

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None


@dataclass(frozen=True, slots=True)
class CorsConfig:
    """The OpenAI HTTP API's CORS rule (vLLM's --allowed-origins, --allowed-methods, --allowed-headers,
    --allow-credentials), so a browser page on another origin may call it; vLLM's defaults: any origin, method and
    header, no credentials."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            values = getattr(self, name)
            if isinstance(values, list):
                object.__setattr__(self, name, values := tuple(values))
            if not isinstance(values, tuple) or not all(isinstance(v, str) and v.strip() for v in values):
                raise ConfigError(name, f"must be a list of non-empty strings, got {values!r}")


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    """Tracing (OTLP), per-request JSON log lines and the periodic stats line (docs/observability.md)."""

    otlp_traces_endpoint: str | None = None  # None: no tracing (OpenTelemetry is not even imported)
    otlp_traces_protocol: str = "grpc"  # or "http/protobuf"
    service_name: str = "pagedserve"  # the spans' service.name
    log_requests: bool = False  # a JSON line per request at admission and at finish
    log_prompts: bool = False  # only then does a request line carry the prompt (its token ids and text)
    log_outputs: bool = False  # vLLM's --enable-log-outputs: the finish line carries each sample's text and ids
    max_log_len: int | None = None  # prompt / output tokens (and characters) logged at most (None: all)
    stats_interval_s: float = 10.0  # the stats line's period (vLLM's); 0: off

    def __post_init__(self) -> None:
        if self.otlp_traces_protocol not in ("grpc", "http/protobuf"):
            raise ConfigError("otlp_traces_protocol", f"unknown protocol {self.otlp_traces_protocol!r}; supported: "
                              "grpc, http/protobuf")
        if self.stats_interval_s < 0:
            raise ConfigError("stats_interval_s", f"must be >= 0 (0: off), got {self.stats_interval_s}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ConfigError("max_log_len", f"must be >= 0, got {self.max_log_len}")
        for name, flag in (("log_prompts", "--log-prompts"), ("log_outputs", "--enable-log-outputs")):
            if getattr(self, name) and not self.log_requests:
                raise ConfigError(name, f"{flag} adds to the request lines: needs --enable-log-requests")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: pick a free port (reported in the ready file and the log)
    tls: TlsConfig | None = None
    # Requests over this size get INVALID_ARGUMENT naming the limit; the transport cuts at twice this.
    max_message_bytes: int = 16 * MIB
    max_send_message_bytes: int = 64 * MIB
    # Keepalive: pings keep idle long-lived streams alive through proxies, and are allowed without calls.
    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    # Bound connection lifetime so clients re-resolve and rebalance behind L4 load balancers (None: unbounded).
    max_connection_age_s: float | None = None
    max_connection_age_grace_s: float = 30.0
    # On SIGTERM: health NOT_SERVING at once, new requests still admitted for drain_delay_s (endpoint
    # propagation), then UNAVAILABLE for new requests and in-flight streams get shutdown_grace_s to finish.
    drain_delay_s: float = 0.0
    shutdown_grace_s: float = 30.0
    metrics_port: int | None = None  # None: no Prometheus endpoint; 0: a free port
    metrics_host: str | None = None  # None: same as host
    served_model_name: str | None = None  # ModelInfo.model and the metrics' model_name label
    # vLLM's --served-model-name's further names: OpenAI requests may name the model by any of them (answers carry
    # the first), and /v1/models lists each
    served_model_aliases: tuple[str, ...] = ()
    # Also serve vllm.grpc.engine.VllmEngine (SMG, vllm-router, llm-d) on the same port and engine.
    vllm_engine_service: bool = True
    ready_file: Path | None = None  # written (JSON: ports, pid) once the model is loaded and the server serves
    http_port: int | None = None  # the OpenAI-compatible HTTP API on `host`; None: off, 0: a free port
    # vLLM's --enable-auto-tool-choice / --tool-call-parser (names checked by service/openai/openai_tools.py)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # --api-key: requests need `Authorization: Bearer KEY` (HTTP) / `authorization` metadata (gRPC); health is exempt
    api_key: str | None = field(default=None, repr=False)
    generation_config: str = "auto"  # vLLM's --generation-config: auto, vllm or a folder (core/request_policy.py)
    max_logprobs: int = 20  # vLLM's --max-logprobs: most logprobs / top_logprobs a request may ask for
    force_include_usage: bool = False  # vLLM's --enable-force-include-usage: streams carry usage on every chunk and end with it
    cors: CorsConfig = CorsConfig()  # the OpenAI HTTP API's CORS rule (vLLM's defaults: any origin, no credentials)
    # vLLM's --override-generation-config (sampling defaults over the model's), --default-chat-template-kwargs and
    # --response-role (service/core/request_policy.py)
    override_generation_config: dict[str, Any] = field(default_factory=dict, hash=False)
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False  # vLLM's flag: logprobs' tokens as "token_id:42" by default
    root_path: str | None = None  # vLLM's --root-path: the OpenAI API's prefix behind a path-routing proxy
    request_id_headers: bool = False  # vLLM's --enable-request-id-headers: every HTTP reply carries x-request-id
    observability: ObservabilityConfig | None = None  # tracing, request and stats logs (None: the defaults)

    def __post_init__(self) -> None:
        if self.api_key is not None:
            ApiKey(self.api_key)  # refuses an empty or padded key at start
        if self.root_path is not None and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ConfigError("root_path", f"must start with / and not end with one (/llm), got {self.root_path!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be in [0, 65535], got {self.port}")
        for name in ("metrics_port", "http_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ConfigError(name, f"must be in [0, 65535], got {value}")
        for name in ("max_message_bytes", "max_send_message_bytes"):
            if getattr(self, name) < 1024:
                raise ConfigError(name, f"must be >= 1024 bytes, got {getattr(self, name)}")
        for name in ("keepalive_time_s", "keepalive_timeout_s", "max_connection_age_grace_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if self.max_connection_age_s is not None and self.max_connection_age_s <= 0:
            raise ConfigError("max_connection_age_s", f"must be > 0, got {self.max_connection_age_s}")
        for name in ("drain_delay_s", "shutdown_grace_s"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")

    def request_policy(self, model_folder: Path | None) -> RequestPolicy:
        """The OpenAI requests' defaults and limits; model_folder: where --generation-config auto looks."""
        return RequestPolicy(generation_defaults(self.generation_config, model_folder, self.override_generation_config),
                             self.max_logprobs, self.force_include_usage, self.default_chat_template_kwargs,
                             self.response_role, self.return_tokens_as_token_ids)

    @property
    def transport_receive_limit(self) -> int:
        return 2 * self.max_message_bytes

    def grpc_options(self) -> list[tuple[str, int]]:
        options = [
            ("grpc.max_receive_message_length", self.transport_receive_limit),
            ("grpc.max_send_message_length", self.max_send_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # Accept client pings as often as every 10 s (the server default of 5 min would GOAWAY them).
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.so_reuseport", 0),
            # Above the 8 KiB default, so that an over-long x-request-id reaches the servicer and gets an
            # INVALID_ARGUMENT naming it instead of a transport-level RESOURCE_EXHAUSTED.
            ("grpc.max_metadata_size", 64 * 1024),
        ]
        if self.max_connection_age_s is not None:
            options.append(("grpc.max_connection_age_ms", int(self.max_connection_age_s * 1000)))
            options.append(("grpc.max_connection_age_grace_ms", int(self.max_connection_age_grace_s * 1000)))
        return options
