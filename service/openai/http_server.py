"""uvicorn serving the OpenAI API on the gRPC server's own event loop (so both share one engine and one drain)."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from typing import Any

import uvicorn
from starlette.middleware.cors import CORSMiddleware

from pagedserve.service.config import CorsConfig, TlsConfig
from pagedserve.service.core.context import ServingContext
from pagedserve.service.core.auth import ApiKey
from pagedserve.service.core.request_policy import RequestPolicy
from pagedserve.service.openai.http_auth import ApiKeyMiddleware
from pagedserve.service.openai.http_middleware import RequestIdHeaders, RootPath
from pagedserve.service.openai.openai_api import OpenAIApi
from pagedserve.service.openai.openai_tools import ToolSettings

log = logging.getLogger(__name__)
_SHUTDOWN_S = 2  # after the drain: idle keep-alive connections get this long before they are closed


class HttpServer:
    """tls: the gRPC port's certificates serve HTTPS too (a client CA makes it mutual TLS, as for gRPC); api_key:
    every route but /health needs it; cors: which other origins' pages may call it (vLLM's default: any);
    root_path: vLLM's --root-path, the prefix a path-routing proxy serves this API under; request_id_headers:
    vLLM's --enable-request-id-headers, every reply carries an x-request-id."""

    def __init__(self, serving: ServingContext, host: str, port: int, max_body_bytes: int,
                 tls: TlsConfig | None = None, tools: ToolSettings = ToolSettings(), api_key: ApiKey | None = None,
                 policy: RequestPolicy = RequestPolicy(), cors: CorsConfig = CorsConfig(), root_path: str | None = None,
                 request_id_headers: bool = False):
        self.socket = _bind(host, port)
        self.port = self.socket.getsockname()[1]
        app = OpenAIApi(serving, max_body_bytes, tools, policy).app()
        app = ApiKeyMiddleware(app, api_key) if api_key else app
        app = RootPath(app, root_path) if root_path else app
        app = RequestIdHeaders(app) if request_id_headers else app
        # outermost, so a browser's preflight (OPTIONS, no key) is answered and a 401 still carries the CORS headers
        app = CORSMiddleware(app, allow_origins=list(cors.allowed_origins), allow_methods=list(cors.allowed_methods),
                             allow_headers=list(cors.allowed_headers), allow_credentials=cors.allow_credentials)
        config = uvicorn.Config(app, lifespan="off", log_config=None,
                                access_log=False, timeout_graceful_shutdown=_SHUTDOWN_S, server_header=False,
                                **_tls_options(tls))
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Returns once uvicorn accepts connections on the bound socket (or raises why it could not)."""
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self.socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await self._task
        except Exception:  # noqa: BLE001 - shutting down regardless; say why it was not clean
            log.exception("HTTP server did not stop cleanly")
        finally:
            self.socket.close()


def _tls_options(tls: TlsConfig | None) -> dict[str, Any]:
    if tls is None:
        return {}
    options: dict[str, Any] = {"ssl_certfile": str(tls.cert_file), "ssl_keyfile": str(tls.key_file)}
    if tls.client_ca_file is not None:
        options |= {"ssl_ca_certs": str(tls.client_ca_file), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return options


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock
