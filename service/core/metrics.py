"""Prometheus metrics under vLLM's names (gateways and dashboards already read them) plus gRPC status counts."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from pagedserve.engine.outputs import RequestMetrics
from pagedserve.engine.structured_output.compiler import COMPILE_BUCKETS, ConstraintStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# vLLM's own buckets (vllm/v1/metrics/loggers.py), so histogram_quantile over a mixed fleet lines up.
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                          20.0, 40.0, 80.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True, slots=True)
class Durations:
    """vLLM's phases: queue (arrival -> first scheduled), prefill (first scheduled -> first token), decode (first
    token -> finished), inference (prefill + decode)."""

    queue_s: float
    time_to_first_token_s: float
    decode_s: float
    total_s: float
    num_preemptions: int
    prefill_s: float = 0.0
    inference_s: float = 0.0

    def time_per_output_token(self, generated_tokens: int) -> float:
        """vLLM's per-request TPOT: decode time over the tokens after the first (0 for a single token)."""
        return self.decode_s / (generated_tokens - 1) if generated_tokens > 1 else 0.0


def durations(metrics: RequestMetrics) -> Durations:
    """Engine timestamps are time.monotonic(); unset ones (never scheduled, still running) count up to now."""
    now = time.monotonic()
    arrival = metrics.arrival_time
    scheduled = metrics.first_scheduled_time or now
    first_token = metrics.first_token_time or now
    finished = metrics.finished_time or now
    return Durations(queue_s=max(0.0, scheduled - arrival), time_to_first_token_s=max(0.0, first_token - arrival),
                     decode_s=max(0.0, finished - first_token), total_s=max(0.0, finished - arrival),
                     num_preemptions=metrics.num_preemptions, prefill_s=max(0.0, first_token - scheduled),
                     inference_s=max(0.0, finished - scheduled))


class EngineStatsCollector(Collector):
    """Gauges and counters the engine owns, read at scrape time so they are never stale."""

    def __init__(self, model_name: str, stats: Callable[[], Any]):
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        s = self.stats()
        if s is None:  # model still loading
            return
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                    s.kv_cache_usage)
        # vLLM's info-style gauge (value 1); the Gateway API Inference Extension's prefix scorer reads its labels.
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache configuration.",
                                 labels=["block_size", "cache_dtype", "num_gpu_blocks"])
        info.add_metric([str(s.block_size), s.kv_cache_dtype, str(s.num_kv_blocks)], 1.0)
        yield info
        yield gauge("pagedserve:kv_cache_blocks_total", "KV-cache blocks in the pool.", s.num_kv_blocks)
        yield gauge("pagedserve:kv_cache_blocks_free", "KV-cache blocks free (including evictable cached).",
                    s.num_free_kv_blocks)
        yield gauge("pagedserve:kv_cache_blocks_active", "KV-cache blocks held by running or waiting requests.",
                    s.num_active_kv_blocks)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Sequences preempted (KV blocks reclaimed, recomputed later).",
                      s.num_preemptions)
        yield counter("pagedserve:requests_aborted", "Unfinished requests aborted in the engine (cancel, deadline).",
                      s.num_aborted_requests)
        yield counter("pagedserve:async_lookahead_steps", "Steps launched before the previous step's tokens were read "
                      "(--async-scheduling).", s.num_lookahead_steps)
        yield from _constraint_metrics(s.constraints, labels, counter)
        if s.max_loras > 0:
            yield lora_requests_info(s.max_loras, s.running_adapters, s.waiting_adapters)
        yield from _spec_decode_metrics(s, labels, counter)


def lora_requests_info(max_loras: int, running: tuple[str, ...], waiting: tuple[str, ...]) -> GaugeMetricFamily:
    """vLLM's gauge as the Gateway API Inference Extension reads it: the adapters with running and with waiting
    requests as comma-separated names (its reader splits on "," without trimming: no spaces), and as value the time
    of this update (unix seconds; a reader keeps the series with the latest). Read at scrape time, so it is the
    engine's state now; names cannot hold commas (engine/lora/config.py)."""
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                               labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    family.add_metric([str(max_loras), ",".join(running), ",".join(waiting)], time.time())
    return family


def _spec_decode_metrics(s: Any, labels: list[str], counter) -> Iterator:
    """Speculative decoding, with vLLM's names: steps that verified drafts (per sequence), drafts, accepted drafts,
    and accepted drafts by position (0: a step's first draft)."""
    yield counter("vllm:spec_decode_num_drafts", "Sequence steps that verified speculative drafts.",
                  s.spec_decode_num_drafts)
    yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                  s.spec_decode_num_draft_tokens)
    yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_decode_num_accepted_tokens)
    family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position.",
                                 labels=["model_name", "position"])
    for position, count in enumerate(s.spec_decode_accepted_per_position):
        family.add_metric([*labels, str(position)], count)
    yield family


def _constraint_metrics(c: ConstraintStats, labels: list[str], counter) -> Iterator:
    """Structured outputs (vLLM exports none of these; named in its style)."""
    yield counter("pagedserve:structured_output_requests", "Constrained (structured-output) requests admitted.",
                  c.num_requests)
    yield counter("pagedserve:structured_output_compile_cache_hits", "Constraints found compiled in the cache.",
                  c.cache_hits)
    yield counter("pagedserve:structured_output_compile_cache_misses", "Constraints compiled (refused ones too).",
                  c.cache_misses)
    family = HistogramMetricFamily("pagedserve:structured_output_compile_seconds",
                                   "Time to compile a constraint for the tokenizer (cache misses).", labels=["model_name"])
    cumulative, buckets = 0, []
    for bound, count in zip((*map(str, COMPILE_BUCKETS), "+Inf"), c.compile_bucket_counts):
        cumulative += count
        buckets.append((bound, cumulative))
    family.add_metric(labels, buckets, c.compile_seconds_sum)
    yield family


class ServiceMetrics:
    def __init__(self, model_name: str, stats: Callable[[], Any]):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(EngineStatsCollector(model_name, stats))
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", m,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", m,
                             buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "Per request: decode time over the "
                              "output tokens after the first.", m, buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", m,
                               buckets=_REQUEST_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finished.", m,
                             buckets=_REQUEST_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.", m,
                                 buckets=_REQUEST_LATENCY_BUCKETS, registry=r)
        self.decode = Histogram("vllm:request_decode_time_seconds", "First token to finished.", m,
                                buckets=_REQUEST_LATENCY_BUCKETS, registry=r)
        self.inference = Histogram("vllm:request_inference_time_seconds", "First scheduled to finished.", m,
                                   buckets=_REQUEST_LATENCY_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens per engine step: prompts that got "
                                          "their first token in the step, plus the tokens it generated.", m,
                                          buckets=_ITERATION_TOKEN_BUCKETS, registry=r)
        # Cumulative per-step token counts, written on the engine thread (the only writer) and read as deltas by
        # the periodic stats line.
        self.step_prompt_tokens = 0
        self.step_generation_tokens = 0
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", m,
                                    buckets=_TOKEN_BUCKETS, registry=r)
        self.gen_len = Histogram("vllm:request_generation_tokens", "Generated tokens per request.", m,
                                 buckets=_TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", m, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        # vLLM counts no requests per adapter; named in its style. Admitted requests, whichever front end sent them.
        self.lora_requests = Counter("pagedserve:lora_requests", "Requests admitted per LoRA adapter.",
                                     ["model_name", "adapter"], registry=r)
        grpc_labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.rpc_started = Counter("grpc_server_started", "RPCs started.", grpc_labels, registry=r)
        self.rpc_handled = Counter("grpc_server_handled", "RPCs completed, by status code.",
                                   [*grpc_labels, "grpc_code"], registry=r)
        self.http_handled = Counter("http_server_handled", "OpenAI HTTP API generation requests completed, by "
                                    "status (499: the client went away first).", ["handler", "status"], registry=r)
        # The model's series, bound once (as vLLM does): labels() costs a locked lookup on every observation.
        self._per_request = tuple(h.labels(model_name) for h in (
            self.ttft, self.queue, self.e2e, self.prefill, self.decode, self.inference, self.tpot, self.prompt_len,
            self.gen_len, self.prompt_tokens, self.generation_tokens))
        self._itl, self._iteration = self.itl.labels(model_name), self.iteration_tokens.labels(model_name)

    def observe_token_times(self, intervals: list[float]) -> None:
        observe = self._itl.observe
        for interval in intervals:
            observe(interval)

    def observe_request(self, metrics: RequestMetrics, prompt_tokens: int, generated_tokens: int, reason: str) -> None:
        """Called once per engine request, whichever front end sent it (service/core/stream.py)."""
        d = durations(metrics)
        ttft, queue, e2e, prefill, decode, inference, tpot, prompt_len, gen_len, prompt, generated = self._per_request
        ttft.observe(d.time_to_first_token_s)
        queue.observe(d.queue_s)
        e2e.observe(d.total_s)
        prefill.observe(d.prefill_s)
        decode.observe(d.decode_s)
        inference.observe(d.inference_s)
        tpot.observe(d.time_per_output_token(generated_tokens))
        prompt_len.observe(prompt_tokens)
        gen_len.observe(generated_tokens)
        prompt.inc(prompt_tokens)
        generated.inc(generated_tokens)
        self.success.labels(self.model_name, reason).inc()

    def observe_unanswered_failure(self) -> None:
        """A request the engine failed before its first output: counted as finished with "error", nothing timed."""
        self.success.labels(self.model_name, "error").inc()

    def observe_step(self, prompt_tokens: int, generation_tokens: int) -> None:
        """One engine step's tokens (vLLM's iteration stats); called on the engine thread."""
        self.step_prompt_tokens += prompt_tokens
        self.step_generation_tokens += generation_tokens
        self._iteration.observe(prompt_tokens + generation_tokens)

    def adapter_requests(self, adapter: str | None, count: int = 1) -> None:
        """Admitted requests that name an adapter (None: the base, not counted here)."""
        if adapter is not None:
            self.lora_requests.labels(self.model_name, adapter).inc(count)

    def http_done(self, handler: str, status: int) -> None:
        self.http_handled.labels(handler, str(status)).inc()

    def rpc_start(self, kind: str, service: str, method: str) -> None:
        self.rpc_started.labels(kind, service, method).inc()

    def rpc_done(self, kind: str, service: str, method: str, code: str) -> None:
        self.rpc_handled.labels(kind, service, method, code).inc()
