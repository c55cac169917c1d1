"""Serving state shared by the front ends and the shutdown path.

loading -> serving -> unready (SIGTERM: health NOT_SERVING, still admitting for --drain-delay, so requests
routed during endpoint propagation still succeed) -> draining (UNAVAILABLE for new requests, in-flight finish).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from pagedserve.service.core.errors import DrainingError

# A health service name that stays SERVING from load to exit, draining included: liveness probes check it, so
# a drain is never mistaken for a hung process (readiness checks "" and goes NOT_SERVING on SIGTERM).
LIVENESS_SERVICE = "liveness"


class ServingState:
    """services: the gRPC services whose health mirrors the server's readiness (besides "")."""

    def __init__(self, health: HealthServicer, services: tuple[str, ...] = ()):
        self.health, self.services = health, services
        self.ready = False
        self.unready = False  # shutting down: readiness fails, admission continues until draining
        self.draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def check_ready(self) -> None:
        if not self.ready:
            raise DrainingError("model is still loading; retry when health reports SERVING")

    def check_admitting(self) -> None:
        self.check_ready()
        if self.draining:
            raise DrainingError("server is draining for shutdown; retry on another replica")

    @contextmanager
    def track(self) -> Iterator[None]:
        """Counts a request as in flight so draining knows when every stream has finished."""
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def mark_serving(self) -> None:
        self.ready = True
        await self.set_status(health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)

    @property
    def accepting_traffic(self) -> bool:
        """What readiness reports: loaded and not shutting down."""
        return self.ready and not self.unready

    async def mark_unready(self) -> None:
        self.unready = True
        await self.set_status(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def start_draining(self) -> None:
        self.draining = True
        await self.mark_unready()

    async def wait_idle(self, timeout: float) -> bool:
        """True when every in-flight request finished within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def set_status(self, status: int) -> None:
        # "" is the whole server (what grpc_health_probe and Kubernetes check by default).
        for name in ("", *self.services):
            await self.health.set(name, status)
