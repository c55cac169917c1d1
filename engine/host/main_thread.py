"""Runs the engine's model load and step loop on the process's main thread, for an event loop on another thread.

Why: with torch's libgomp OpenMP, parallel regions launched from a thread other than the initial one ran far
slower here (2 cores, torch 2.13): an elementwise op on [64, 1536] took 45 us instead of 8 us, and the whole
engine ran at 0.7x its main-thread speed (267 vs 380 output tok/s, bf16, 2 threads). So the gRPC server puts
asyncio on a side thread and hands the compute to the main thread through this host. Python delivers signals
to the main thread only, so the host also relays them to whoever registered for them.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

# How often a blocked main thread (the host, or the idle step loop it runs) wakes to let Python run pending
# signal handlers.
SIGNAL_POLL_S = 0.5


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class MainThreadHost:
    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = threading.Event()
        self._on_signal: Callable[[int], None] | None = None
        self._early_signals: list[int] = []  # arrived before anyone registered: replayed on registration

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """From an event loop: runs fn(*args) on the host thread and returns (or raises) its outcome."""
        if self._closed.is_set():
            raise RuntimeError("the main-thread host is closed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((fn, args, loop, future))
        return await future

    @property
    def closed(self) -> bool:
        """Long jobs (the step loop) poll this: once the event loop's side is gone, nothing may keep running."""
        return self._closed.is_set()

    def close(self) -> None:
        """Makes run() return once the job in progress (if any) ends; thread-safe."""
        self._closed.set()
        self._jobs.put(None)

    def run(self) -> None:
        """On the main thread: runs jobs in order until close()."""
        assert threading.current_thread() is threading.main_thread(), "run() belongs on the main thread"
        while True:
            try:
                job = self._jobs.get(timeout=SIGNAL_POLL_S)
            except queue.Empty:
                continue
            if job is None:
                return
            fn, args, loop, future = job
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:
                pass  # that event loop is gone: nobody awaits the outcome any more

    # -- signals (Python runs handlers on the main thread only) ------------------------------------------
    def relay_signals_to(self, callback: Callable[[int], None]) -> None:
        self._on_signal = callback
        early, self._early_signals = self._early_signals, []
        for signum in early:
            callback(signum)

    def signal(self, signum: int, _frame: Any = None) -> None:
        """Installed as the main thread's handler (signal.signal's signature)."""
        if self._closed.is_set():
            return  # the server side is gone; its shutdown is already under way
        if self._on_signal is None:
            self._early_signals.append(signum)
        else:
            self._on_signal(signum)
