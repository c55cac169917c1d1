"""What the engine hands back: per-request outputs (cumulative and delta) and engine-wide stats."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.sequence import TokenLogprob


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int
    num_cached_tokens: int

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    index: int
    text: str  # everything released so far (text that might still become a stop string is held back)
    token_ids: tuple[int, ...]
    new_text: str  # released since the previous output of this request
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprob, ...]
    logprobs: tuple[TokenLogprob, ...]  # cumulative; empty unless SamplingParams.logprobs is set
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None  # the matched stop string or stop token id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set (with finished) when the request failed on its own, see FinishReason.ERROR


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_active_kv_blocks: int  # referenced by a running or waiting sequence (free-but-cached blocks excluded)
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_aborted_requests: int  # unfinished requests stopped by abort_request (cancel, deadline, shutdown)
    block_size: int
    max_model_len: int

    @property
    def kv_cache_usage(self) -> float:
        return self.num_active_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """What the engine serves, for ModelInfo-style endpoints."""

    architecture: str
    quantization: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_kv_blocks: int
    model_path: str  # the HF folder or .gguf file
    tokenizer_path: str  # the folder of HF tokenizer files the engine reads (GetTokenizer serves it)
    model_type: str  # the HF config's model_type
