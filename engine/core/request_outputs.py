"""The engine's requests (each one's sequences: n > 1 samples fork off the first) and the outputs built from them
after every step: only what is new since a request's previous output is copied."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.sequence import Sequence, TokenLogprob
from pagedserve.engine.pooling import PoolingState
from pagedserve.engine.outputs import CompletionOutput, EngineStats, OutputHistory, RequestMetrics, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.spec_decode.verifier import SpecCounters
from pagedserve.engine.structured_output.compiler import ConstraintStats


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    # (None, then prompt token 1's logprob, ...): built once, when the prefill has scored the whole prompt
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    @property
    def finished(self) -> bool:
        for seq in self.seqs:  # a loop, not all() over a generator: read for every request after every step
            if not seq.is_finished or seq.pending_forks:
                return False
        return True


def request_output(state: RequestState) -> RequestOutput:
    """Built for every running request after every step, so its cost is per-token host time on a GPU; one sample
    (n = 1, nearly every request) skips the sort and the generators over samples (8 -> 5 us a request)."""
    seqs = state.seqs
    first = seqs[0]
    finished = state.finished
    if len(seqs) == 1:
        m = first.metrics
        completions = (_completion(first),)
        metrics = RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time or None,
                                 (m.finished_time or 0.0) if finished else None, m.num_preemptions,
                                 m.num_cached_tokens)
    else:
        completions = tuple(_completion(seq) for seq in sorted(seqs, key=lambda s: s.index))
        metrics = _samples_metrics(seqs, finished)
    pooled = first.features.of(PoolingState)
    return RequestOutput(state.request_id, state.prompt_token_ids, completions, finished, metrics,
                         prompt_logprobs=_prompt_logprobs(state), embedding=None if pooled is None else pooled.vector)


def _samples_metrics(seqs: list[Sequence], finished: bool) -> RequestMetrics:
    """n > 1: the first token of any sample, the last sample's end, every sample's preemptions."""
    first = seqs[0].metrics
    return RequestMetrics(
        arrival_time=first.arrival_time,
        first_scheduled_time=first.first_scheduled_time,
        first_token_time=min((s.metrics.first_token_time for s in seqs if s.metrics.first_token_time), default=None),
        finished_time=max((s.metrics.finished_time or 0.0 for s in seqs), default=None) if finished else None,
        num_preemptions=sum(s.metrics.num_preemptions for s in seqs),
        num_cached_tokens=first.num_cached_tokens,
    )


def _prompt_logprobs(state: RequestState) -> tuple[TokenLogprob | None, ...] | None:
    """The request's prompt logprobs once all are computed (by its first sample: n > 1 samples fork after it)"""
    if state.prompt_logprobs is None and state.params.prompt_logprobs is not None:
        first = next((s for s in state.seqs if s.index == 0), None)
        scored = first.prompt_logprobs if first is not None else ()
        if len(scored) == len(state.prompt_token_ids) - 1:
            state.prompt_logprobs = (None, *scored)
    return state.prompt_logprobs


def _completion(seq: Sequence) -> CompletionOutput:
    """What the sequence produced since its previous output; text that may still grow into a stop string waits.
    Only the new tokens are copied: the history stays in the sequence's append-only lists (OutputHistory)."""
    hold = 0 if seq.is_finished or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
    release = max(seq.emitted_text_len, seq.text.length - hold)
    emitted = seq.emitted_token_len
    completion = CompletionOutput(
        index=seq.index,
        new_text=seq.text.tail(seq.emitted_text_len)[: release - seq.emitted_text_len],
        new_token_ids=tuple(seq.token_ids[seq.num_prompt_tokens + emitted :]),
        new_logprobs=tuple(seq.logprobs[emitted:]),
        num_tokens=seq.num_output_tokens,
        finish_reason=seq.finish_reason.value if seq.finish_reason else None,
        stop_reason=seq.stop_reason,
        history=OutputHistory(seq.token_ids, seq.num_prompt_tokens, seq.logprobs, len(seq.logprobs), seq.text.pieces,
                              release),
    )
    seq.emitted_text_len, seq.emitted_token_len = release, seq.num_output_tokens
    return completion


def engine_stats(scheduler: Scheduler, spec: SpecCounters, constraints: ConstraintStats, max_model_len: int,
                 kv_cache_dtype: str, max_loras: int, num_aborted_requests: int,
                 num_lookahead_steps: int = 0) -> EngineStats:
    bm = scheduler.block_manager
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_kv_blocks=bm.num_blocks,
        num_free_kv_blocks=bm.num_free_blocks,
        num_active_kv_blocks=bm.num_used_blocks,
        prefix_cache_queries=bm.prefix_queries,
        prefix_cache_hits=bm.prefix_hits,
        num_preemptions=scheduler.num_preemptions,
        num_aborted_requests=num_aborted_requests,
        constraints=constraints,
        block_size=bm.block_size,
        max_model_len=max_model_len,
        kv_cache_dtype=kv_cache_dtype,
        max_loras=max_loras,
        running_adapters=scheduler.running_adapters(),
        waiting_adapters=scheduler.waiting_adapters(),
        spec_decode_num_drafts=spec.num_drafts,
        spec_decode_num_draft_tokens=spec.num_draft_tokens,
        spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
        spec_decode_accepted_per_position=tuple(spec.accepted_per_position),
        num_lookahead_steps=num_lookahead_steps,
    )
