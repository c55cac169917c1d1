"""MainThreadHost: jobs from an event loop on a side thread run on the main thread (where the gRPC server's
engine computes), outcomes and errors come back, close() ends run(), and signals are relayed, early ones too."""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest

from pagedserve.engine.host.main_thread import MainThreadHost


def _serve_side(host: MainThreadHost, coro_fn, outcome: dict) -> threading.Thread:
    def side() -> None:
        try:
            outcome["value"] = asyncio.run(coro_fn())
        except BaseException as exc:  # noqa: BLE001
            outcome["error"] = exc
        finally:
            host.close()

    thread = threading.Thread(target=side)
    thread.start()
    return thread


def test_jobs_run_on_the_main_thread_in_order_with_their_outcomes() -> None:
    assert threading.current_thread() is threading.main_thread()  # pytest runs tests on the main thread
    host, outcome = MainThreadHost(), {}

    async def client() -> list:
        names = [await host.call(lambda: threading.current_thread().name) for _ in range(3)]
        total = await host.call(sum, [1, 2, 3])
        with pytest.raises(ZeroDivisionError):
            await host.call(lambda: 1 / 0)
        return names + [total]

    side = _serve_side(host, client, outcome)
    host.run()  # returns once the side thread closes the host
    side.join()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["value"] == [threading.main_thread().name] * 3 + [6]
    assert host.closed


def test_call_after_close_is_refused() -> None:
    host = MainThreadHost()
    host.close()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(host.call(int))
    host.run()  # a closed host's run() returns at once


def test_signals_are_relayed_and_early_ones_replayed() -> None:
    host, seen = MainThreadHost(), []
    host.signal(signal.SIGTERM)  # before anyone registered
    host.relay_signals_to(seen.append)
    host.signal(signal.SIGINT, None)
    assert seen == [signal.SIGTERM, signal.SIGINT]
    host.close()
    host.signal(signal.SIGTERM)  # after close: the server is already stopping
    assert seen == [signal.SIGTERM, signal.SIGINT]


def test_step_loop_job_stops_when_the_event_loop_side_is_gone() -> None:
    """A long job that polls `closed` (the engine's step loop does) ends when the server side closes the host."""
    host, outcome, started = MainThreadHost(), {}, threading.Event()

    def step_loop() -> str:
        started.set()
        while not host.closed:
            threading.Event().wait(0.01)
        return "stopped"

    async def client() -> None:
        job = asyncio.ensure_future(host.call(step_loop))
        await asyncio.to_thread(started.wait, 10)
        job.cancel()  # the event loop gives up on it; close() in _serve_side must still end the job

    side = _serve_side(host, client, outcome)
    host.run()
    side.join(10)
    assert not side.is_alive() and "error" not in outcome
