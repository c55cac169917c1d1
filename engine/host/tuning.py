"""The host tuning a CPU engine runs under, applied once by the entry that builds the engine, on the thread that will
compute (torch's compute-thread count belongs to the calling thread): torch's threads from the process's CPU budget,
glibc's allocator thresholds, and, for a spinning OpenMP pool, the thread governor the engine ticks every step."""

from __future__ import annotations

import os

import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.host.allocator import keep_freed_memory
from pagedserve.engine.host.cpu_threads import configure_cpu_threads
from pagedserve.engine.host.thread_governor import GovernorConfig, ThreadGovernor, start_governor
from pagedserve.kernels.cpu.native import pool_sleeps


def tune_host(config: EngineConfig) -> ThreadGovernor | None:
    """Sets the compute threads (and on CPU the allocator) for `config`; returns the governor for
    `LLMEngine(config, governor=...)`, or None where none should run."""
    if torch.device(config.device).type != "cpu":
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        return None
    threads = configure_cpu_threads(config.num_threads)
    keep_freed_memory()
    # Only a spinning pool needs the governor: sleeping threads already leave a taken core to its process.
    if config.adapt_threads and config.num_threads is None and threads > 1 and not pool_sleeps(os.environ):
        return start_governor(GovernorConfig(max_threads=threads), torch.set_num_threads)
    return None
