"""Wraps RPC implementations: typed errors become status codes, and every call is counted by its final code."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from pagedserve.service.core.errors import RpcError, to_rpc_error
from pagedserve.service.core.metrics import ServiceMetrics

log = logging.getLogger(__name__)

StreamImpl = Callable[[bytes, grpc.aio.ServicerContext], AsyncIterator[Any]]
UnaryImpl = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]


def streaming(metrics: ServiceMetrics, service: str, method: str, impl: StreamImpl) -> StreamImpl:
    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        metrics.rpc_start("server_stream", service, method)
        code = "OK"
        try:
            async for item in impl(raw, context):
                yield item
        except asyncio.CancelledError:
            code = cancel_code(context)
            raise
        except Exception as exc:
            error = rpc_error(exc, method)
            code = error.code.name
            await context.abort(error.code, error.message)
        finally:
            metrics.rpc_done("server_stream", service, method, code)

    return handler


def unary(metrics: ServiceMetrics, service: str, method: str, impl: UnaryImpl) -> UnaryImpl:
    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        metrics.rpc_start("unary", service, method)
        code = "OK"
        try:
            return await impl(raw, context)
        except asyncio.CancelledError:
            code = cancel_code(context)
            raise
        except Exception as exc:
            error = rpc_error(exc, method)
            code = error.code.name
            await context.abort(error.code, error.message)
        finally:
            metrics.rpc_done("unary", service, method, code)

    return handler


def cancel_code(context: grpc.aio.ServicerContext) -> str:
    """grpc.aio cancels the handler for both client cancellation and an expired deadline; tell them apart."""
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"


def rpc_error(exc: Exception, method: str) -> RpcError:
    error = to_rpc_error(exc)
    if error.code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
    return error
