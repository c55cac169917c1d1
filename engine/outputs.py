"""What the engine hands back: per-request outputs (deltas, with the history readable on demand) and engine-wide
stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.engine.core.sequence import TokenLogprob
from pagedserve.engine.structured_output.compiler import ConstraintStats


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class OutputHistory:
    """A sequence's output so far, as references to its append-only token, logprob and text-piece lists plus the
    lengths that were released: O(1) to make each step, copied only when read."""

    tokens: list[int]  # prompt + output, appended to by the engine thread
    prompt_len: int
    logprobs: list[TokenLogprob]
    num_logprobs: int
    text_pieces: list[str]
    text_len: int


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One sample's progress since the request's previous output (the `new_*` deltas front ends stream) and how it
    finished. `token_ids`, `text` and `logprobs` give the whole history up to this output, built when read."""

    index: int
    new_text: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprob, ...]  # empty unless SamplingParams.logprobs is set
    num_tokens: int  # generated so far, the new ones included
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error" | "constraint_dead_end"
    stop_reason: str | int | None  # the matched stop string or stop token id
    history: OutputHistory = field(repr=False, compare=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> tuple[int, ...]:
        start = self.history.prompt_len
        return tuple(self.history.tokens[start : start + self.num_tokens])

    @property
    def text(self) -> str:
        """Everything released so far (text that might still become a stop string is held back)."""
        return "".join(self.history.text_pieces)[: self.history.text_len]

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...]:
        return tuple(self.history.logprobs[: self.history.num_logprobs])


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set (with finished) when the request failed on its own, see FinishReason.ERROR
    # SamplingParams.prompt_logprobs: None for the first prompt token, then each one's logprob (vLLM's layout); set
    # on every output from the one after the prefill scored the whole prompt
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # An embedding request's vector (`engine/pooling.py`), on its one, finished output; None for generations
    embedding: tuple[float, ...] | None = None


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
    kv_cache_dtype: str = ""  # the cache's dtype as resolved (auto -> bf16, fp8 -> fp8_e4m3)
    constraints: ConstraintStats = ConstraintStats()  # structured outputs: requests, compiles, cache hits
    # LoRA (vllm:lora_requests_info): adapter names with a running / waiting request, in first-seen order
    max_loras: int = 0  # 0: LoRA off
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    # Speculative decoding (vLLM's vllm:spec_decode_* counters): sequences verified with drafts, drafts, accepted
    # drafts, and accepted drafts by their position (0: the first draft of a step)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] = ()
    num_lookahead_steps: int = 0  # async scheduling: steps launched before the previous step's tokens were read

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
    reasoning_parser: str = ""  # the thought markers' format (engine/reasoning.py); "": none
    runner: str = "generate"  # "pooling": the engine answers embeddings only (engine/pooling.py)
    pooling_type: str = ""  # the pooling runner's: LAST, MEAN or CLS
    embedding_size: int = 0  # the pooling runner's embedding width (before a request's Matryoshka cut)


def step_token_counts(outputs: list[RequestOutput]) -> tuple[int, int]:
    """One step's (prompt tokens, generated tokens) as vLLM's iteration stats count them: the whole prompt of a
    request in the step that gave its first token, plus every token the step generated."""
    prompt = generated = 0
    for out in outputs:
        new = [len(c.new_token_ids) for c in out.outputs]
        generated += sum(new)
        # A sample whose every token is new got its first token in this step (samples fork in the same step).
        if any(k and k == c.num_tokens for k, c in zip(new, out.outputs)):
            prompt += len(out.prompt_token_ids)
    return prompt, generated
