"""The engine behind asyncio: one thread runs the step loop; each request streams through its own queue.

Adds and aborts are handed to the loop thread as commands and applied between steps, so a cancelled
request stops (and frees its KV blocks) within one engine step.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.sequence import now
from pagedserve.engine.errors import EngineDeadError, PagedServeError, RequestFailedError, StepFailedError
from pagedserve.engine.kv_events import KvEvent
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.loop_commands import (
    Abort, AdapterCall, Add, ResetPrefixCache, Sink, deliver, put_all, resolve, settle,
)
from pagedserve.engine.lora.config import AdapterInfo, LoraModule
from pagedserve.engine.outputs import EngineStats, ModelDescription, RequestOutput, step_token_counts
from pagedserve.engine.requests import AdmittedRequest, EmbeddingRequest, GenerationRequest
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.stream_table import StreamTable

logger = logging.getLogger(__name__)


# How often the idle step loop wakes: on a main-thread host that lets Python run pending signal handlers.
IDLE_WAKE_S = 0.5


class LoopHost(Protocol):
    """A thread that runs the model load and the step loop for the event loop (`engine/host/main_thread.py`'s
    `MainThreadHost`)."""

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    @property
    def closed(self) -> bool: ...


class AsyncEngine:
    """host: run the model load and step loop on the main thread through it; without one they run on a worker
    thread of their own. build: makes the LLMEngine on that thread (the entry's host tuning goes there, since
    torch's thread count belongs to the thread that computes); default `LLMEngine(config)`."""

    def __init__(
        self, config: EngineConfig, engine: LLMEngine | None = None, host: LoopHost | None = None,
        build: Callable[[], LLMEngine] | None = None,
    ):
        self.config = config
        self.engine = engine
        self._build = build or functools.partial(LLMEngine, config)
        self._host = host
        self._host_loop: asyncio.Future | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams = StreamTable(config.max_queued_requests)
        self._submissions = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats: EngineStats | None = None
        self.dead_reason: str | None = None
        self._kv_sink: Callable[[list[KvEvent]], None] | None = None
        self._step_sink: Callable[[int, int], None] | None = None

    def publish_kv_events(self, sink: Callable[[list[KvEvent]], None]) -> None:
        """Hands each step's prefix-cache events to `sink`, on the engine thread, in order (one sink per engine).
        The sink must not block: it runs between engine steps."""
        self.engine.block_manager.record_events()
        self._kv_sink = sink

    def observe_steps(self, sink: Callable[[int, int], None]) -> None:
        """Hands each step's token counts to `sink(prompt_tokens, generation_tokens)` on the engine thread, as vLLM's
        iteration stats count them: the whole prompt of a request in the step that gave its first token, plus the
        tokens the step generated. The sink must not block."""
        self._step_sink = sink

    async def start(self) -> None:
        """Loads the model off the event loop (on the host's main thread, or a worker thread) and starts the step
        loop there (host) or on a thread of its own."""
        if self.engine is None:
            loading = self._host.call(self._build) if self._host else asyncio.to_thread(self._build)
            self.engine = await loading
        self._stats = self.engine.stats()
        if self._host is not None:
            self._host_loop = asyncio.ensure_future(self._host.call(self._run))
            return
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self._stats

    def describe(self) -> ModelDescription:
        return self.engine.describe()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def admit(self, request: GenerationRequest | EmbeddingRequest) -> AdmittedRequest:
        """Checks a request once, in the caller's thread (front ends send long prompts and constrained requests, whose
        grammar compiles here, to a worker thread: `service/core/admit.py`)."""
        return self.engine.admission.admit(request)

    async def load_adapter(self, module: LoraModule) -> AdapterInfo:
        """Reads and validates the PEFT folder in a worker thread (off the event loop and the step loop), then
        registers it on the loop thread between steps."""
        read = await asyncio.to_thread(self.engine.read_adapter, module)
        return await self._adapter_call(functools.partial(self.engine.register_adapter, read))

    async def unload_adapter(self, name: str) -> None:
        """Applied between steps; AdapterInUseError while a request using it is unfinished."""
        await self._adapter_call(functools.partial(self.engine.unload_adapter, name))

    def adapters(self) -> tuple[AdapterInfo, ...]:
        return self.engine.adapters()

    async def _adapter_call(self, apply: Callable[[], Any]) -> Any:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        done = asyncio.get_running_loop().create_future()
        self._send(AdapterCall(apply, done))
        return await done

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The offline API's request (a text or token-id prompt, see LLMEngine.add_request) as a stream; a constraint
        (or an evicted adapter's reload) runs in a worker thread, never on the event loop."""
        if params.constraint is not None or adapter is not None:
            admitted = await asyncio.to_thread(self.engine.admit_prompt, prompt, params, adapter)
        else:
            admitted = self.engine.admit_prompt(prompt, params)
        stream = self.stream(request_id, admitted)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()  # leaving early aborts now, not when the stream is garbage-collected

    async def stream(self, request_id: str, request: AdmittedRequest) -> AsyncIterator[RequestOutput]:
        """Yields outputs as they are produced; leaving the loop early (or cancellation) aborts the request."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        sink = Sink(asyncio.get_running_loop(), asyncio.Queue(), request_id, f"{request_id}#{next(self._submissions)}")
        self._streams.register(sink, self._stats.num_waiting if self._stats else 0)
        self._send(Add(request, now(), sink))
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                # Release the id now, not when the loop thread gets to the abort: a client that saw its stream
                # end may retry with the same id at once. Commands run in order, so the engine drops this
                # request before it adds the retry.
                self._streams.release(sink)
                self._send(Abort(sink, released=True))

    async def abort(self, request_id: str) -> None:
        """Aborts the request now in flight under this client id (if any); its stream gets the final output."""
        sink = self._streams.of_client(request_id)
        if sink is not None:
            self._send(Abort(sink, released=False))

    async def reset_prefix_cache(self) -> int:
        """Drops the prefix cache between two steps without touching running requests; returns the blocks dropped."""
        done = asyncio.get_running_loop().create_future()
        self._send(ResetPrefixCache(done))
        return await done

    def _send(self, command: Add | Abort | ResetPrefixCache | AdapterCall) -> None:
        self._commands.put(command)
        self._wakeup.set()

    async def shutdown(self) -> None:
        self.dead_reason = "the engine is shutting down"
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        if self._host_loop is not None:
            await self._host_loop

    # -- the loop thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping and not (self._host is not None and self._host.closed):
            try:
                self._iterate()
            except Exception as exc:  # a dead loop thread would leave every stream waiting forever
                logger.exception("engine loop failed; aborting the requests in flight")
                self._fail_all(StepFailedError(f"the engine step computing this request failed: {exc}"))
        self._fail_all(EngineDeadError("the engine is shutting down"))

    def _iterate(self) -> None:
        """Commands, then one step and its delivery. Whatever raises here (a bug in the step, which no single
        request's guard caught, or in the loop's own bookkeeping) fails the requests in flight, and serving goes on."""
        self._apply_commands()
        self._flush_kv_events()  # a cache reset changes the cache without a step
        if not self.engine.has_unfinished_requests():
            self._wakeup.wait(IDLE_WAKE_S)
            self._wakeup.clear()
            return
        outputs = self.engine.step()
        self._stats = self.engine.stats()
        self._flush_kv_events()
        if self._step_sink is not None:
            self._observe_step(outputs)
        self._deliver(outputs)

    def _apply_commands(self) -> None:
        applied_adds = 0
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Add):
                applied_adds += 1
                self._apply_add(command)
            elif isinstance(command, ResetPrefixCache):
                dropped = self.engine.block_manager.reset_prefix_cache()
                resolve(command.done, dropped)
            elif isinstance(command, AdapterCall):
                settle(command)
            else:
                out = self.engine.abort_request(command.sink.engine_id)
                if self._streams.forget(command.sink) and not command.released and out is not None:
                    command.sink.put(out)
        # Refresh the waiting count before un-counting the adds, so admission never sees a request twice-missed.
        self._stats = self.engine.stats()
        self._streams.adds_applied(applied_adds)

    def _flush_kv_events(self) -> None:
        if self._kv_sink is None:
            return
        events = self.engine.block_manager.take_events()
        if events:
            try:
                self._kv_sink(events)
            except Exception:  # a broken listener must not stop the engine
                logger.exception("KV event listener failed")

    def _observe_step(self, outputs: list[RequestOutput]) -> None:
        try:
            self._step_sink(*step_token_counts(outputs))
        except Exception:  # a broken listener must not stop the engine
            logger.exception("step listener failed")

    def _apply_add(self, command: Add) -> None:
        sink = command.sink
        if not self._streams.is_live(sink):  # aborted before it reached the loop
            return
        try:
            self.engine.submit(sink.engine_id, command.request, command.arrival_time)
        except PagedServeError as exc:
            self._streams.forget(sink)
            sink.put(exc)
        except Exception as exc:  # a bug submitting one request fails that request, not the commands behind it
            logger.exception("request %s could not be submitted", sink.request_id)
            self.engine.abort_request(sink.engine_id)
            self._streams.forget(sink)
            sink.put(RequestFailedError(f"internal error while submitting the request ({type(exc).__name__}: {exc})"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for loop, items in self._streams.route(outputs).items():
            if not deliver(loop, put_all, items):
                self._abandon(loop)

    def _abandon(self, loop: asyncio.AbstractEventLoop) -> None:
        """A caller's event loop closed with streams in flight: their requests are aborted (blocks freed), since no
        one can read them; the other callers' streams go on."""
        sinks = self._streams.take_loop(loop)
        logger.warning("an event loop closed with %d streams in flight; aborting them", len(sinks))
        for sink in sinks:
            self.engine.abort_request(sink.engine_id)

    def _fail_all(self, error: PagedServeError) -> None:
        for sink in self._streams.take_all():
            self.engine.abort_request(sink.engine_id)
            sink.put(error)
        self._stats = self.engine.stats()
