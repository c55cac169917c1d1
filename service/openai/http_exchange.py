"""One HTTP exchange at the ASGI level: a size-limited JSON body, JSON or SSE replies, and client disconnects.

Generation endpoints are plain ASGI callables (not Starlette request handlers) because they must notice a client
that goes away while they wait on the engine, with or without a stream open: one task per exchange watches for the
`http.disconnect` message and cancels the wait it interrupts, which cancels the engine stream and so aborts the
request. (Racing each wait against that message with `asyncio.wait` cost a task and a wait per streamed token: a
third of the event loop's work per token.)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pagedserve.engine.request_id import check_request_id
from pagedserve.service.openai.openai_errors import ErrorReply, HttpError, error_reply

T = TypeVar("T")
log = logging.getLogger(__name__)
_DRAIN_FACTOR = 16  # an over-limit body is read and dropped up to this many limits, so the client sees the 413
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class ClientGone(Exception):
    """The client disconnected; nothing more can be sent."""


async def answer(scope: dict[str, Any], receive: Any, send: Any, handle: Callable[[Exchange], Awaitable[None]],
                 done: Callable[[str, int], None]) -> None:
    """One exchange of an ASGI route: `handle` answers it; any failure becomes OpenAI's error JSON (an error event
    mid-stream), never a dropped connection; a client that left gets nothing (its engine requests were cancelled,
    which aborted them and freed their blocks). `done(path, status)` counts it."""
    exchange = Exchange(scope, receive, send)
    try:
        exchange.check_request_id_header()
        await handle(exchange)
    except ClientGone:
        pass
    except Exception as exc:  # noqa: BLE001 - every failure is classified in one place (error_reply)
        reply = error_reply(exc)
        if not isinstance(exc, HttpError) and reply.status == 500:
            log.exception("HTTP request failed")
        try:
            await exchange.send_error(reply)
        except OSError:
            pass
    finally:
        exchange.close()
        done(scope["path"], exchange.status)


async def read_json_body(receive: Any, limit: int) -> Any:
    """The request body as JSON, read through the ASGI `receive` up to `limit` bytes (413 beyond, 400 if not JSON)."""
    body = await _read_body(receive, limit)
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise HttpError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None


async def _read_body(receive: Any, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        size += len(message.get("body", b""))
        if size <= limit:
            chunks.append(message.get("body", b""))
        if not message.get("more_body", False) or size > limit * _DRAIN_FACTOR:
            break
    if size > limit:
        raise HttpError(413, f"the request body is {size} bytes or more, over the server limit of {limit} bytes "
                        "(--max-message-bytes)", code="request_too_large")
    return b"".join(chunks)


class Exchange:
    def __init__(self, scope: dict[str, Any], receive: Any, send: Any):
        self.scope, self._receive, self._send = scope, receive, send
        self.started = False
        self.status = 499  # until a reply starts: nginx's "client closed request"
        self._watch: asyncio.Task | None = None  # reads the request's messages until the client disconnects
        self._gone = False  # the client disconnected (and the watch cancelled the wait it found, if any)
        self._waiter: asyncio.Task | None = None  # the task inside until_disconnect, which the watch cancels
        self._echo: list[tuple[bytes, bytes]] = []  # x-request-id, once checked (check_request_id_header)
        self.request_id: str | None = None  # the client's x-request-id, once checked

    def check_request_id_header(self) -> None:
        """A client's x-request-id is echoed on every reply (as gRPC echoes its metadata), once it passes the one
        request-id rule; a bad one is refused naming the header."""
        for key, value in self.scope.get("headers", ()):
            if key == b"x-request-id":
                self.request_id = check_request_id(value.decode("latin-1"), "x-request-id")
                self._echo = [(key, value)]
                return

    async def json_body(self, limit: int) -> Any:
        return await read_json_body(self._receive, limit)

    async def until_disconnect(self, awaitable: Awaitable[T]) -> T:
        """The awaitable's result, unless the client disconnects first: then it is cancelled and ClientGone raised.
        Awaited in the calling task: a disconnect cancels that task's wait, not a task of its own."""
        if self._gone:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()  # never started: nothing to clean up, and no "never awaited" warning
            raise ClientGone()
        if self._watch is None:
            self._watch = asyncio.ensure_future(self._watch_disconnect())
        self._waiter = asyncio.current_task()
        try:
            return await awaitable
        except asyncio.CancelledError:
            if not self._gone:  # set only by the watch, together with its cancel of this wait
                raise  # cancelled from outside (a shutdown): stays a cancellation
            self._waiter.uncancel()
            raise ClientGone() from None
        finally:
            self._waiter = None

    async def _watch_disconnect(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._gone = True
        if self._waiter is not None:  # suspended in until_disconnect's await: the cancellation lands there
            self._waiter.cancel()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    async def send_json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        await self._start(status, [(b"content-type", b"application/json"),
                                   (b"content-length", str(len(data)).encode()), *extra])
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def send_error(self, reply: ErrorReply) -> None:
        if self.started:  # mid-stream: OpenAI's SDKs read an error event, then the stream ends
            await self.sse(reply.body)
            await self.end_sse()
        else:
            await self.send_json(reply.status, reply.body, reply.headers)

    async def start_sse(self) -> None:
        await self._start(200, SSE_HEADERS)

    async def sse(self, payload: Any, event: str | None = None) -> None:
        """One event: `data:` JSON, after an `event:` line when named (the Responses API names each event)."""
        data = b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
        if event is not None:
            data = b"event: " + event.encode() + b"\n" + data
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end_sse(self, done_marker: bool = True) -> None:
        """The stream's end: `data: [DONE]` (chat and completions), or nothing more (the Responses API)."""
        await self._send({"type": "http.response.body", "body": b"data: [DONE]\n\n" if done_marker else b"",
                          "more_body": False})

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started, self.status = True, status
        await self._send({"type": "http.response.start", "status": status, "headers": [*headers, *self._echo]})
