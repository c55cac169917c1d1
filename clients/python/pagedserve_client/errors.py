"""Client-side errors: one class carrying the gRPC status, so callers branch on `.code`, not on grpc internals."""

from __future__ import annotations

import grpc


class ClientError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @property
    def field(self) -> str | None:
        """The request field an INVALID_ARGUMENT (or NOT_FOUND: an unknown adapter) names ("sampling.top_p: must be
        ..." -> "sampling.top_p")."""
        named = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        if self.code not in named or ": " not in self.details:
            return None
        return self.details.split(": ", 1)[0]

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> ClientError:
        code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
        details = error.details() if callable(getattr(error, "details", None)) else str(error)
        return cls(code, details or "")
