"""Compiles constraints for one engine's tokenizer: cached by (kind, spec, choices), bounded in time, counted.

Called by `Admission.admit` on the admitting thread (a worker thread for served requests, `service/core/admit.py`),
never on the step loop. The grammar library itself is built on first use (building its tokenizer view takes about
a second), so engines that never see a constraint never pay for it.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from pagedserve.engine.constraint import OutputConstraint
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.structured_output.backend import CompiledConstraint, GrammarBackend

# Seconds; the Prometheus histogram's buckets (service/core/metrics.py exports them as they are).
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class ConstraintStats:
    """Cumulative since the engine started (EngineStats.constraints)."""

    num_requests: int = 0  # constrained requests admitted
    cache_hits: int = 0
    cache_misses: int = 0  # compiles run (rejected and timed-out ones included)
    compile_bucket_counts: tuple[int, ...] = (0,) * (len(COMPILE_BUCKETS) + 1)  # per bucket, the last one +Inf
    compile_seconds_sum: float = 0.0


class ConstraintCompiler:
    """Thread-safe. `timeout_s` bounds one compile; a compile that overruns is refused (its worker finishes in the
    background and is not cached) and counts in the histogram at the limit."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], timeout_s: float, cache_size: int = 1024):
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_error: str | None = None  # the library could not take this tokenizer: said once, kept
        self.timeout_s, self.cache_size = timeout_s, cache_size
        self._cache: OrderedDict[tuple, CompiledConstraint] = OrderedDict()
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="constraint-compile")
        self._requests = self._hits = self._misses = 0
        self._buckets = [0] * (len(COMPILE_BUCKETS) + 1)
        self._seconds = 0.0

    def backend(self) -> GrammarBackend | None:
        with self._backend_lock:
            if self._backend is None and self._backend_error is None:
                try:
                    self._backend = self._make_backend()
                except Exception as exc:  # e.g. a tokenizer the library cannot read (not a fast tokenizer)
                    self._backend_error = f"{type(exc).__name__}: {exc}"
            return self._backend

    def compile(self, constraint: OutputConstraint) -> CompiledConstraint:
        key = (constraint.kind, constraint.spec, constraint.choices)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self._requests, self._hits = self._requests + 1, self._hits + 1
                return CompiledConstraint(constraint, cached.compiled, cached.backend, 0.0)
        backend = self.backend()
        if backend is None:
            raise InvalidRequestError(constraint.field, "structured outputs are unavailable for this model's "
                                      f"tokenizer: {self._backend_error}")
        start = time.perf_counter()
        future = self._pool.submit(backend.compile, constraint)
        try:
            compiled = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._count(self.timeout_s, ok=False)
            raise InvalidRequestError(constraint.field, f"did not compile within {self.timeout_s:g} s; simplify it") from None
        except Exception as exc:  # ConstraintRejected, or whatever else the library raises on this input
            self._count(time.perf_counter() - start, ok=False)
            raise InvalidRequestError(constraint.field, f"rejected by the grammar compiler: {exc}") from None
        result = CompiledConstraint(constraint, compiled, backend, time.perf_counter() - start)
        self._count(result.compile_seconds, ok=True)
        with self._lock:
            self._cache[key] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return result

    def _count(self, seconds: float, ok: bool) -> None:
        with self._lock:
            self._misses += 1
            self._requests += ok
            self._buckets[bisect.bisect_left(COMPILE_BUCKETS, seconds)] += 1
            self._seconds += seconds

    def stats(self) -> ConstraintStats:
        with self._lock:
            return ConstraintStats(self._requests, self._hits, self._misses, tuple(self._buckets), self._seconds)
