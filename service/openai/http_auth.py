"""`--api-key` on the OpenAI HTTP API: an ASGI wrapper refusing requests without `Authorization: Bearer KEY` with
OpenAI's 401 error JSON, before any route runs; /health, /load and /metrics stay open for load balancers and
scrapers (as on the separate metrics port)."""

from __future__ import annotations

import json
from typing import Any

from pagedserve.service.core.auth import REFUSAL, ApiKey

EXEMPT_PATHS = frozenset({"/health", "/metrics", "/load"})


class ApiKeyMiddleware:
    def __init__(self, app: Any, key: ApiKey):
        self.app, self.key = app, key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or route_path(scope) in EXEMPT_PATHS or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": REFUSAL, "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _allowed(self, scope: dict[str, Any]) -> bool:
        headers = [value for name, value in scope["headers"] if name == b"authorization"]
        return len(headers) == 1 and self.key.allows(headers[0])


def route_path(scope: dict[str, Any]) -> str:
    """The path the routes match, as starlette's router reads it: --root-path's prefix taken off when present."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path
