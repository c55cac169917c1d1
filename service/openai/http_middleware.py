"""ASGI wrappers for vLLM's HTTP-server flags that touch every route alike: `--root-path` (routes answer under a
proxy's prefix and without it, as FastAPI's root_path does) and `--enable-request-id-headers` (every reply carries
an x-request-id: the client's, or one made here, which the generation routes then log and answer under)."""

from __future__ import annotations

import uuid
from typing import Any

_HEADER = b"x-request-id"


class RootPath:
    def __init__(self, app: Any, root_path: str):
        self.app, self.root_path = app, root_path

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


class RequestIdHeaders:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = [value for name, value in scope["headers"] if name == _HEADER]
        request_id = given[0] if given else uuid.uuid4().hex.encode()
        if not given:  # as if the client had sent it: the route's own x-request-id handling takes it from here
            scope = {**scope, "headers": [*scope["headers"], (_HEADER, request_id)]}

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(name.lower() == _HEADER for name, _ in headers):
                    message = {**message, "headers": [*headers, (_HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
