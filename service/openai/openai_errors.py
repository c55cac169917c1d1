"""Typed errors -> OpenAI's error JSON and HTTP status, through the same classification gRPC
uses (service/core/errors.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from pagedserve.engine.errors import AdapterInUseError, InvalidRequestError, MissingChatTemplateError
from pagedserve.service.core.errors import RuntimeUpdatesOffError, to_rpc_error

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.UNIMPLEMENTED: (400, "invalid_request_error"),  # the other task's API (vLLM answers 400 too)
}
# Where HTTP (as vLLM answers) is finer than the gRPC code: an adapter in use is a conflict, and runtime adapter
# updates that are off are routes that do not exist.
_HTTP_STATUS = ((AdapterInUseError, 409), (RuntimeUpdatesOffError, 404))


class HttpError(Exception):
    """An error only HTTP has (unknown route or model, a body too large or not JSON): status and JSON as given."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


@dataclass(frozen=True, slots=True)
class ErrorReply:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def error_reply(exc: BaseException, rename: Any = None) -> ErrorReply:
    """rename: engine field -> the OpenAI parameter the client set (OpenAIRequest.param), when known."""
    if isinstance(exc, HttpError):
        return _reply(exc.status, exc.kind, exc.message, exc.param, exc.code)
    rpc = to_rpc_error(exc)
    status, kind = _STATUS.get(rpc.code, (500, "server_error"))
    status = next((s for cls, s in _HTTP_STATUS if isinstance(exc, cls)), status)
    param, message = None, rpc.message
    if isinstance(exc, InvalidRequestError):
        param = rename(exc.field) if rename else exc.field
        message = f"{param}: {exc.message}"
    elif isinstance(exc, MissingChatTemplateError):
        param = "messages"
    code = rpc.code.name.lower() if status != 500 else "internal_error"
    reply = _reply(status, kind, message, param, code)
    if status in (429, 503):
        reply.headers["retry-after"] = "1"
    return reply


def _reply(status: int, kind: str, message: str, param: str | None, code: str | None) -> ErrorReply:
    return ErrorReply(status, {"error": {"message": message, "type": kind, "param": param, "code": code}}, {})
