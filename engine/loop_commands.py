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
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def put_all(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


def settle(call: AdapterCall) -> None:
    try:
        result = call.apply()
    except Exception as exc:  # the caller gets the error; the loop goes on
        call.done.get_loop().call_soon_threadsafe(_set_exception, call.done, exc)
        return
    resolve(call.done, result)


def resolve(future: asyncio.Future, result: Any) -> None:
    """From the engine thread: sets future's result on its own loop, unless its caller has given up on it (a
    cancelled future cannot take a result, and setting one would be an error on the caller's loop)."""
    future.get_loop().call_soon_threadsafe(_set_result, future, result)


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
