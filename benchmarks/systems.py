"""In-process systems behind one interface, so drivers can warm them up and interleave them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from metrics import RequestTiming
from workload import Workload, WorkloadConfig, build_workload

# Small enough to be quick, large enough to touch prefill, decode and batching paths.
WARMUP = WorkloadConfig(num_requests=4, prompt_len_min=16, prompt_len_max=48, output_len_min=4,
                        output_len_max=8, seed=99)


@dataclass(frozen=True, slots=True)
class SystemRun:
    timings: list[RequestTiming]
    peak_kv_blocks: int | None
    extra: dict


class System(Protocol):
    name: str

    def run(self, workload: Workload) -> SystemRun: ...


@dataclass(frozen=True, slots=True)
class SystemSpec:
    model_dir: str
    dtype: str
    threads: int
    # Off by default: repeats replay identical prompts, so a prefix cache would turn
    # every repeat after the first into a cache hit (the random prompts share nothing).
    prefix_caching: bool = False


class PagedServeSystem:
    name = "pagedserve"

    def __init__(self, spec: SystemSpec) -> None:
        from pagedserve_runner import make_engine

        self.engine = make_engine(spec.model_dir, spec.dtype, spec.threads,
                                  enable_prefix_caching=spec.prefix_caching)

    def run(self, workload: Workload) -> SystemRun:
        from pagedserve_runner import run_engine

        r = run_engine(self.engine, workload)
        return SystemRun(r.timings, r.peak_kv_blocks, r.extra)


class HFStaticSystem:
    name = "hf_static"

    def __init__(self, spec: SystemSpec) -> None:
        from hf_baselines import load_model

        _set_threads(spec.threads)
        self.model = load_model(spec.model_dir, spec.dtype)

    def run(self, workload: Workload) -> SystemRun:
        from hf_baselines import run_static

        r = run_static(self.model, workload)
        return SystemRun(r.timings, r.peak_kv_blocks, r.extra)


class HFContinuousSystem:
    name = "hf_cb"

    def __init__(self, spec: SystemSpec) -> None:
        from hf_baselines import load_model

        _set_threads(spec.threads)
        # its own model object: init_continuous_batching switches the attention implementation
        self.model = load_model(spec.model_dir, spec.dtype)
        self.prefix_caching = spec.prefix_caching

    def run(self, workload: Workload) -> SystemRun:
        from hf_baselines import run_continuous

        r = run_continuous(self.model, workload, prefix_sharing=self.prefix_caching)
        return SystemRun(r.timings, r.peak_kv_blocks, r.extra)


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


SYSTEMS: dict[str, Callable[[SystemSpec], System]] = {
    PagedServeSystem.name: PagedServeSystem,
    HFStaticSystem.name: HFStaticSystem,
    HFContinuousSystem.name: HFContinuousSystem,
}


def create_system(name: str, spec: SystemSpec) -> System:
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; supported: {', '.join(SYSTEMS)}")
    system = SYSTEMS[name](spec)
    system.run(build_workload(WARMUP))
    return system
