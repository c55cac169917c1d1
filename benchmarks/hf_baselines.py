"""transformers baselines: one static padded `generate`, and its continuous batching.

Both run greedy with EOS ignored and every request's own output length, on the same
workload and clock as pagedserve (see metrics.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from metrics import RequestTiming
from workload import Workload

_TORCH_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True, slots=True)
class HFRun:
    timings: list[RequestTiming]
    peak_kv_blocks: int | None  # in 16-token blocks, comparable with pagedserve's default
    extra: dict


def load_model(model_dir: str, dtype: str, attn: str = "sdpa"):
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {_TORCH_DTYPES}, got {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                 attn_implementation=attn)
    return model.eval()


class _StepClock:
    """A generate() streamer that only records when each decoding step's tokens appear."""

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if not self._seen_prompt:  # generate() first pushes the prompt itself
            self._seen_prompt = True
            return
        self.step_times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_static(model, workload: Workload) -> HFRun:
    """One left-padded batch of every request, run to the longest output length.
    Poisson arrivals make no sense here, so the batch starts when the last request
    has arrived (their TTFT includes that wait)."""
    import torch

    reqs = workload.requests
    width = max(len(r.prompt_token_ids) for r in reqs)
    max_new = max(r.max_tokens for r in reqs)
    ids = torch.zeros(len(reqs), width, dtype=torch.long)
    mask = torch.zeros(len(reqs), width, dtype=torch.long)
    for i, r in enumerate(reqs):
        ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[i, width - len(r.prompt_token_ids):] = 1
    clock = _StepClock()
    t0 = time.perf_counter()
    _sleep_until(t0 + reqs[-1].arrival_s)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, streamer=clock,
                             pad_token_id=0, eos_token_id=None)
    timings = [RequestTiming(r.request_id, t0 + r.arrival_s, tuple(clock.step_times[:r.max_tokens]),
                             tuple(out[i, width:width + r.max_tokens].tolist()))
               for i, r in enumerate(reqs)]
    blocks = len(reqs) * math.ceil((width + max_new) / 16)
    return HFRun(timings, blocks, {"padded_prompt_len": width, "steps": max_new})


def run_continuous(model, workload: Workload, page_size: int = 16, max_batch_tokens: int = 512,
                   kv_tokens: int | None = None, prefix_sharing: bool = False) -> HFRun:
    """transformers' ContinuousBatchingManager; requests are submitted at their
    arrival times from this thread while its worker thread generates. On CPU it
    needs an explicit cache geometry (it cannot size the cache from device memory)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    reqs = workload.requests
    if kv_tokens is None:  # room for every request at once: no preemption in the baseline
        kv_tokens = sum(len(r.prompt_token_ids) + r.max_tokens + page_size for r in reqs)
    num_blocks = math.ceil(kv_tokens / page_size)
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in reqs),
                               eos_token_id=None, pad_token_id=0)
    cb_cfg = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks,
                                      max_batch_tokens=max_batch_tokens,
                                      allow_block_sharing=prefix_sharing)
    manager = model.init_continuous_batching(generation_config=gen_cfg,
                                             continuous_batching_config=cb_cfg)
    manager.start()
    try:
        t0 = time.perf_counter()
        for r in reqs:
            _sleep_until(t0 + r.arrival_s)
            manager.add_request(list(r.prompt_token_ids), request_id=r.request_id,
                                max_new_tokens=r.max_tokens, record_timestamps=True, eos_token_id=-1)
        results, peak_frac = _collect(manager, len(reqs))
    finally:
        manager.stop(block=True, timeout=30)
    timings = [RequestTiming(r.request_id, t0 + r.arrival_s, tuple(results[r.request_id].timestamps),
                             tuple(results[r.request_id].generated_tokens)) for r in reqs]
    peak = None if peak_frac is None else round(peak_frac * num_blocks)
    return HFRun(timings, peak, {"num_blocks": num_blocks, "page_size": page_size,
                                 "max_batch_tokens": max_batch_tokens})


def _collect(manager, count: int) -> tuple[dict, float | None]:
    results: dict = {}
    peak_used = None
    while len(results) < count:
        out = manager.get_result(timeout=0.05)
        peak_used = _max(peak_used, _used_cache_fraction(manager))
        if out is None:
            if not manager.is_running():
                raise RuntimeError(f"transformers CB worker died after {len(results)}/{count} requests")
            continue
        if out.is_finished():
            if out.error:
                raise RuntimeError(f"transformers CB request {out.request_id} failed: {out.error}")
            results[out.request_id] = out
    return results, peak_used


def _used_cache_fraction(manager) -> float | None:
    """Sampled from this thread while the worker runs, so it may miss a short peak."""
    processor = getattr(manager, "batch_processor", None)
    cache = getattr(processor, "cache", None)
    return None if cache is None else 1.0 - cache.compute_free_capacity(relative=True)


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
