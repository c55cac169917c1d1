"""The KV cache's size in bytes: --kv-cache-memory as given; on CUDA with --gpu-memory-utilization, what a
profiled full-size step leaves of that share of the device (vLLM's rule); otherwise DEFAULT_KV_CACHE_MEMORY.

The share's accounting, as vLLM's: allowed = utilization x the device's total memory, and the cache gets allowed
minus what this process holds without it: everything torch has allocated before the step (the weights and
buffers), the step's peak allocation above that (activations, logits), and what the step grew outside torch's
allocator (cuBLAS and Triton workspaces). The CUDA context and the CUDA graphs captured afterwards are not counted,
as vLLM does not count them: they live in the part of the device left out of the share. Other processes' memory is
not charged to the share, but the cache must fit in what is free now, or the start is refused naming the flag.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from pagedserve.engine.errors import ConfigError
from pagedserve.engine.runner.profile_step import ProfileShape, ProfileTarget, run_profile_step, scratch_cache
from pagedserve.kernels.kv_cache import KVCacheSpec

logger = logging.getLogger(__name__)

_GIB = 2**30


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One reading of a CUDA device's memory, in bytes."""

    total: int
    free: int
    allocated: int  # torch's allocator: live tensors of this process
    reserved: int  # torch's allocator: held from the device, live or cached

    @classmethod
    def read(cls, device: torch.device) -> DeviceMemory:
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return cls(total, free, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))


@dataclass(frozen=True, slots=True)
class StepMemory:
    """The profiled step: the device before the scratch cache, before the step (the scratch cache allocated) and
    after it, and torch's peak allocation during it."""

    before_cache: DeviceMemory
    before_step: DeviceMemory
    after_step: DeviceMemory
    peak_allocated: int

    @property
    def activations(self) -> int:
        return max(0, self.peak_allocated - self.before_step.allocated)

    @property
    def outside_torch(self) -> int:
        grew = self.before_step.free - self.after_step.free
        return max(0, grew - (self.after_step.reserved - self.before_step.reserved))

    @property
    def held_without_cache(self) -> int:
        return self.before_cache.allocated + self.activations + self.outside_torch


def kv_bytes_for_share(utilization: float, step: StepMemory, free_now: int) -> int:
    """The cache's bytes within `utilization` of the device; `free_now`: the device's free memory once the
    profile's scratch is released. Refused (naming the flag) when nothing is left or it does not fit."""
    total = step.before_cache.total
    allowed, held = int(utilization * total), step.held_without_cache
    kv = allowed - held
    if kv <= 0:
        raise ConfigError("gpu_memory_utilization", (
            f"--gpu-memory-utilization {utilization} allows {allowed / _GIB:.2f} GiB of the device's "
            f"{total / _GIB:.2f} GiB, and the weights and one full-size step take {held / _GIB:.2f} GiB of it, "
            f"leaving none for the KV cache: raise it, or lower --max-num-batched-tokens"))
    if kv > free_now:
        raise ConfigError("gpu_memory_utilization", (
            f"--gpu-memory-utilization {utilization} leaves {kv / _GIB:.2f} GiB for the KV cache, but only "
            f"{free_now / _GIB:.2f} GiB of the device is free (other processes hold the rest): lower it, or give "
            f"--kv-cache-memory"))
    return kv


def profile_cuda_step(spec: KVCacheSpec, target: ProfileTarget, shape: ProfileShape, vocab_size: int,
                      device: torch.device) -> StepMemory:
    """Runs the dummy full-size step (engine/runner/profile_step.py) and reads the device around it."""
    torch.cuda.empty_cache()
    before_cache = DeviceMemory.read(device)
    cache = scratch_cache(spec, shape, device)
    before_step = DeviceMemory.read(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_profile_step(target, cache, shape, vocab_size)
    after_step = DeviceMemory.read(device)
    return StepMemory(before_cache, before_step, after_step, torch.cuda.max_memory_allocated(device))


def kv_cache_bytes(config: EngineConfig, device: torch.device, profile: Callable[[], StepMemory]) -> int:
    """The cache's budget for this engine (the module's rule); `profile` runs only where the share decides it."""
    utilization = config.gpu_memory_utilization
    if config.kv_cache_memory is not None:
        if utilization is not None:
            logger.info("--kv-cache-memory %d given: --gpu-memory-utilization %s is not used (as vLLM)",
                        config.kv_cache_memory, utilization)
        return config.kv_cache_memory
    if utilization is None:
        return DEFAULT_KV_CACHE_MEMORY
    if device.type != "cuda":
        logger.warning("--gpu-memory-utilization has no effect on %s: the KV cache gets %.2f GiB (--kv-cache-memory "
                       "sizes it)", device.type, DEFAULT_KV_CACHE_MEMORY / _GIB)
        return DEFAULT_KV_CACHE_MEMORY
    step = profile()
    torch.cuda.empty_cache()  # the scratch cache and the step's activations go back to the device
    kv = kv_bytes_for_share(utilization, step, DeviceMemory.read(device).free)
    logger.info("--gpu-memory-utilization %s of %.2f GiB: weights and buffers %.2f GiB, one full-size step %.2f GiB "
                "(%.2f GiB outside torch), KV cache %.2f GiB", utilization, step.before_cache.total / _GIB,
                step.before_cache.allocated / _GIB, step.activations / _GIB, step.outside_torch / _GIB, kv / _GIB)
    return kv
