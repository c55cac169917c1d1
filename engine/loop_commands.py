"""The commands the asyncio side hands to AsyncEngine's loop thread, and the sink that carries a request's outputs
back: applied between steps, so every change to the engine happens on the thread that steps it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.requests import AdmittedRequest


@dataclass(frozen=True, slots=True)
class Add:
    request: AdmittedRequest
    arrival_time: float
    sink: "Sink"


@dataclass(frozen=True, slots=True)
class Abort:
    sink: "Sink"
    # True when the request's own stream gave up (it already released the id and reads nothing more); False
    # for an abort on the server's behalf, whose stream still wants its final output.
    released: bool


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    done: asyncio.Future  # the number of cached blocks dropped, set on the caller's loop


@dataclass(frozen=True, slots=True)
class AdapterCall:
    """An adapter registration or unload, applied on the loop thread between steps; its result (or error) goes to
    `done` on the caller's loop."""

    apply: Callable[[], Any]
    done: asyncio.Future


@dataclass(frozen=True, slots=True)
class Sink:
    """Delivers outputs (or an exception) from the loop thread into the request's asyncio queue.

    engine_id is unique per submission, so a client id reused right after a cancel can never receive the
    old request's outputs or abort the new one."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request_id: str
    engine_id: str

    def put(self, item: RequestOutput | BaseException) -> None:
        """Dropped when the caller's event loop is closed: nobody can read it."""
        deliver(self.loop, put_all, [(self.queue, item)])


def deliver(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> bool:
    """Schedules `callback(*args)` on `loop` from the loop thread; False, not an error, when that loop is closed
    (a caller that ran its own loop and closed it with a stream in flight): the loop thread must never die of it."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise
        return False
    return True


def put_all(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


def settle(call: AdapterCall) -> None:
    try:
        result = call.apply()
    except Exception as exc:  # the caller gets the error; the loop goes on
        deliver(call.done.get_loop(), _set_exception, call.done, exc)
        return
    resolve(call.done, result)


def resolve(future: asyncio.Future, result: Any) -> None:
    """From the engine thread: sets future's result on its own loop, unless its caller has given up on it (a
    cancelled future cannot take a result, and setting one would be an error on the caller's loop)."""
    deliver(future.get_loop(), _set_result, future, result)


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
