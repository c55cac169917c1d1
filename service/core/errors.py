"""Typed errors -> gRPC status codes. The one place that decides which code a failure gets."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from pagedserve.engine.errors import (
    AdapterInUseError,
    AdapterNotFoundError,
    CapacityError,
    ConfigError,
    EngineDeadError,
    InvalidRequestError,
    MissingChatTemplateError,
    ModelLoadError,
    PagedServeError,
    QueueFullError,
    RequestFailedError,
    StepFailedError,
    UnsupportedError,
    UnsupportedTaskError,
)


class DrainingError(PagedServeError):
    """The server stopped admitting requests (SIGTERM); clients should retry on another replica."""


class RuntimeUpdatesOffError(PagedServeError):
    """A LoRA adapter load or unload while runtime updates are off (HTTP 404, as in vLLM, which then has no such
    routes)."""


@dataclass(frozen=True, slots=True)
class RpcError:
    code: grpc.StatusCode
    message: str


# Ordered: the first matching class wins, so subclasses come before their bases.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (AdapterNotFoundError, grpc.StatusCode.NOT_FOUND),  # an InvalidRequestError naming the field
    (AdapterInUseError, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnsupportedError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnsupportedTaskError, grpc.StatusCode.UNIMPLEMENTED),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DrainingError, grpc.StatusCode.UNAVAILABLE),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (StepFailedError, grpc.StatusCode.UNAVAILABLE),
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
    (RuntimeUpdatesOffError, grpc.StatusCode.FAILED_PRECONDITION),
    (ModelLoadError, grpc.StatusCode.FAILED_PRECONDITION),
    (MissingChatTemplateError, grpc.StatusCode.FAILED_PRECONDITION),
    # A server-side failure of this one request (non-finite logits, or an exception in its own sampling, mask,
    # verification or stop rules; parameters are bounded at the edge), which its batch mates do not share.
    (RequestFailedError, grpc.StatusCode.INTERNAL),
)


def to_rpc_error(exc: BaseException) -> RpcError:
    """INTERNAL only for failures that are our bug, never for a client mistake."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return RpcError(code, _describe(exc))
    return RpcError(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def _describe(exc: BaseException) -> str:
    # Some engine errors carry (field, message) positionally; render them as "field: message" like the rest.
    if len(exc.args) > 1 and all(isinstance(a, str) for a in exc.args):
        return ": ".join(exc.args)
    return str(exc) or type(exc).__name__
