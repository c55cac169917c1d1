"""`--api-key`: every request carries `Authorization: Bearer KEY` (HTTP header, or gRPC `authorization` metadata);
health checks are exempt, so load balancers and kubelets probe without it (metrics are on their own port).

The comparison is constant-time (hmac.compare_digest), so response timing says nothing about how much of a guess
was right. A wrong or missing key: HTTP 401, gRPC UNAUTHENTICATED, and the request never reaches the engine.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from pagedserve.engine.errors import ConfigError

GRPC_EXEMPT_PREFIX = "/grpc.health.v1.Health/"
REFUSAL = "a valid API key is required: send `Authorization: Bearer <key>` (the server's --api-key)"


@dataclass(frozen=True, slots=True)
class ApiKey:
    key: str

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key or self.key != self.key.strip():
            raise ConfigError("api_key", "must be a non-empty string without surrounding whitespace")

    def allows(self, authorization: str | bytes | None) -> bool:
        """authorization: the header's (or metadata's) value, e.g. "Bearer KEY"."""
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        scheme, _, token = (authorization or "").strip().partition(" ")
        matches = hmac.compare_digest(token.strip().encode(), self.key.encode())
        return scheme.lower() == "bearer" and matches


class GrpcApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC but health checks without the key, before the method's handler runs."""

    def __init__(self, key: ApiKey):
        self.key = key

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(GRPC_EXEMPT_PREFIX):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self.key.allows(metadata.get("authorization")):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        yield  # pragma: no cover - an async generator, as streaming handlers are

    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **codec)
    return grpc.unary_unary_rpc_method_handler(unary, **codec)
