"""The metrics port's HTTP app: Prometheus /metrics, plus /ready and /live for probes that speak HTTP only.

Kubernetes can probe grpc.health.v1 directly; meshes, L7 load balancers and plain HTTP checkers often cannot,
so readiness is mirrored here: /ready is 200 only while the server is loaded and not shutting down (503 during
--drain-delay and the drain), /live is 200 while the process serves HTTP at all.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

_TEXT = [("Content-Type", "text/plain; charset=utf-8")]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        """Probes hit these paths every few seconds; access logs would drown the server's own."""


def probe_app(registry: CollectorRegistry, ready: Callable[[], bool]) -> Callable:
    metrics = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/ready":
            ok = ready()
            start_response("200 OK" if ok else "503 Service Unavailable", _TEXT)
            return [b"ready\n" if ok else b"not ready\n"]
        if path == "/live":
            start_response("200 OK", _TEXT)
            return [b"live\n"]
        return metrics(environ, start_response)

    return app


def serve_http(registry: CollectorRegistry, ready: Callable[[], bool], host: str, port: int) -> int:
    """Starts the app on a daemon thread; returns the bound port (port 0 picks one)."""

    class Server(ThreadingWSGIServer):
        address_family = _family(host)

    httpd = make_server(host, port, probe_app(registry, ready), Server, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="pagedserve-http", daemon=True).start()
    return httpd.server_address[1]


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
