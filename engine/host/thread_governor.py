"""Fewer compute threads while other processes take some of this process's CPUs; back to all when they leave.

Why: every parallel region ends at a barrier, so a region is as slow as its slowest thread. When another process
runs on one of the engine's cores, the thread there gets a share of that core and the whole step waits for it: with
2 threads and one busy process on the second core, a spinning pool fell to 0.11x of its quiet throughput, and one
thread alone keeps ~0.6x (docs/cpu-threads.md). Sleeping threads (OMP_WAIT_POLICY=PASSIVE) degrade gracefully too,
but pay a wake-up per region on a quiet machine; the governor lets the pool spin and still step aside.

How: every `window_s` of wall time spent stepping, the engine's step loop compares the busy time of the CPUs in its
affinity mask (/proc/stat, all processes) with its own CPU time; the difference is what others took, in CPUs. A
window restarts when the engine comes back from idle: a neighbour busy while it had nothing to do took nothing from
it. Threads drop once others take more than `taken_at` of a CPU for `busy_windows` windows in a row, and come back
only after `calm_windows` quiet windows, so a competitor that comes and goes cannot make the count flap every window,
and a neighbour's burst shorter than a window or two (a sidecar's start, a previous benchmark's spinning threads
winding down) does not halve the engine for the second it takes to come back. Where /proc/stat cannot be
read (not Linux), there is no governor.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pagedserve.engine.errors import ConfigError

logger = logging.getLogger(__name__)

# /proc/stat's per-CPU fields: user nice system idle iowait irq softirq steal guest guest_nice; guest time is
# already in user/nice, and steal is capacity the hypervisor took away, which hurts a barrier as much.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class CpuSample:
    wall_s: float
    busy_s: float  # busy seconds of the watched CPUs, every process together
    own_s: float  # this process's CPU seconds


@dataclass(frozen=True, slots=True)
class GovernorConfig:
    max_threads: int
    window_s: float = 0.5
    # CPUs' worth of time other processes take before a thread steps aside: a CPU-bound process on one core
    # measured 0.9 beside a spinning 2-thread engine; a light neighbour (a sidecar, a load generator) far less.
    taken_at: float = 0.5
    busy_windows: int = 2
    calm_windows: int = 2

    def __post_init__(self) -> None:
        if self.max_threads < 1 or self.window_s <= 0 or not 0 < self.taken_at < 1 or self.calm_windows < 1 \
                or self.busy_windows < 1:
            raise ConfigError("adapt_threads", f"invalid thread governor settings: {self}")


def read_sample(cpus: frozenset[int], stat: Path = Path("/proc/stat")) -> CpuSample:
    """The watched CPUs' busy time from /proc/stat, this process's CPU time, and the monotonic clock."""
    busy_ticks = 0
    for line in stat.read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            busy_ticks += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return CpuSample(time.monotonic(), busy_ticks / _TICKS_PER_S, time.process_time())


def others_cpus(before: CpuSample, after: CpuSample) -> float:
    """CPUs' worth of time other processes took on the watched CPUs between two samples (never negative)."""
    wall = after.wall_s - before.wall_s
    if wall <= 0:
        return 0.0
    return max(0.0, ((after.busy_s - before.busy_s) - (after.own_s - before.own_s)) / wall)


def threads_for(max_threads: int, taken: float, taken_at: float) -> int:
    """All threads but one per CPU that others hold a real share of (at least one thread)."""
    return max(1, max_threads - max(0, math.ceil(taken - taken_at)))


class ThreadGovernor:
    def __init__(
        self,
        config: GovernorConfig,
        set_threads: Callable[[int], None],
        sample: Callable[[], CpuSample] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        cpus = frozenset(os.sched_getaffinity(0))
        self.config = config
        self._set_threads = set_threads
        self._sample = sample or (lambda: read_sample(cpus))
        self._clock = clock
        self._last = self._sample()
        self._idle_since = clock()
        self.threads = config.max_threads
        self._calm = self._busy = 0

    def step_done(self) -> None:
        """Called when an engine step ends: from here until the next tick the engine is idle."""
        self._idle_since = self._clock()

    def tick(self) -> int:
        """Called when an engine step starts; samples at most once per window. Returns the thread count to use."""
        if self._clock() - self._idle_since > self.config.window_s:
            # The engine sat idle: what others did meanwhile took nothing from it, so a new window starts here.
            self._last = self._sample()
            return self.threads
        now = self._sample() if self._due() else None
        if now is None:
            return self.threads
        taken, self._last = others_cpus(self._last, now), now
        wanted = threads_for(self.config.max_threads, taken, self.config.taken_at)
        self._busy = self._busy + 1 if wanted < self.threads else 0
        self._calm = self._calm + 1 if wanted > self.threads else 0
        if self._busy >= self.config.busy_windows or self._calm >= self.config.calm_windows:
            self._change(wanted, taken)
        return self.threads

    def _due(self) -> bool:
        return self._clock() - self._last.wall_s >= self.config.window_s

    def _change(self, threads: int, taken: float) -> None:
        # Fewer threads is worth an operator's attention (a neighbour is taking cores); more is recovery.
        level = logging.WARNING if threads < self.threads else logging.INFO
        logger.log(level, "compute threads %d -> %d (other processes took %.2f of this process's CPUs)",
                   self.threads, threads, taken)
        self.threads, self._calm, self._busy = threads, 0, 0
        self._set_threads(threads)


def start_governor(config: GovernorConfig, set_threads: Callable[[int], None]) -> ThreadGovernor | None:
    """A governor reading /proc/stat, or None (logged) where it cannot be read."""
    try:
        return ThreadGovernor(config, set_threads)
    except OSError as error:
        logger.info("no thread governor: %s", error)
        return None
