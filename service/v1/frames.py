"""Stream events (service/core/stream.py) -> pagedserve.v1 GenerateResponse frames: Heartbeats while queued,
Started, then Deltas, then one Final per index."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.core.sequence import FinishReason, TokenLogprob
from pagedserve.service.core.metrics import durations
from pagedserve.service.core.stream import Ended, Heartbeat, StreamEvent
from pagedserve.service.core.thought_reader import ThoughtReader
from pagedserve.v1 import generate_pb2 as pb


@dataclass(slots=True)
class _Completion:
    finished: bool = False
    num_tokens: int = 0
    last: CompletionOutput | None = None  # FINAL_ONLY mode sends its history (text, token ids, logprobs) at the end
    thought: ThoughtReader | None = None  # --reasoning-parser, chat input: the thought goes to Delta.reasoning
    # What the thought reader reads on every Delta: the text so far, grown by each output's new text (a
    # CompletionOutput's `text` joins its whole history on every read: quadratic over a long stream)
    text: str = ""


class FrameBuilder:
    """Stateful per stream: remembers what was sent for each completion index."""

    def __init__(self, request_id: str, prompt_tokens: int, truncated: bool, params: SamplingParams,
                 stream_mode: int, thought: ThoughtReader | None = None):
        """thought: a reader for each completion's thought (a fresh copy per index); None: text is all content."""
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.truncated = truncated
        self.params = params
        self.final_only = stream_mode == pb.STREAM_MODE_FINAL_ONLY
        self.started = False
        self.cached_tokens = 0
        self.completions = [_Completion(thought=None if thought is None else replace(thought))
                            for _ in range(params.n)]

    @property
    def all_finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def frames(self, event: StreamEvent) -> list[pb.GenerateResponse]:
        if isinstance(event, Heartbeat):
            return [pb.GenerateResponse(heartbeat=pb.Heartbeat(num_waiting=event.num_waiting))]
        if isinstance(event, Ended):
            reason = pb.FINISH_REASON_TIME_LIMIT if event.timed_out else pb.FINISH_REASON_CANCELLED
            return self.unfinished_finals(reason, event.metrics)
        return self._output_frames(event)

    def _output_frames(self, output: RequestOutput) -> list[pb.GenerateResponse]:
        frames: list[pb.GenerateResponse] = []
        self.cached_tokens = output.metrics.num_cached_tokens
        if not self.started:
            self.started = True
            frames.append(self._started(output.prompt_logprobs))
        for completion in output.outputs:
            state = self.completions[completion.index]
            if state.finished:
                continue
            frames.extend(self._completion_frames(completion, state, output.metrics))
        return frames

    def unfinished_finals(self, reason: int, metrics: RequestMetrics) -> list[pb.GenerateResponse]:
        """Finals for completions the engine never finished (time limit, shutdown): each still ends with a Final."""
        frames = [] if self.started else [self._started()]
        self.started = True
        for index, state in enumerate(self.completions):
            if not state.finished:
                if self.final_only:
                    frames.append(self._history_delta(index, state))
                state.finished = True
                frames.append(self._final(index, reason, None, state, metrics))
        return frames

    def _started(self, prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None) -> pb.GenerateResponse:
        started = pb.Started(request_id=self.request_id, prompt_tokens=self.prompt_tokens,
                             cached_tokens=self.cached_tokens, truncated=self.truncated)
        if self.params.seed is not None:
            started.seed = self.params.seed
        if prompt_logprobs is not None:  # the engine's first entry (the first prompt token) has no score
            started.prompt_logprobs.extend(_token_logprob(lp) for lp in prompt_logprobs[1:])
        return pb.GenerateResponse(index=0, started=started)

    def _completion_frames(self, completion: CompletionOutput, state: _Completion,
                           metrics: RequestMetrics) -> list[pb.GenerateResponse]:
        frames = []
        new_ids = list(completion.new_token_ids)
        state.num_tokens += len(new_ids)
        logprobs = list(completion.new_logprobs)
        if self.final_only:
            state.last = completion
        elif new_ids or completion.new_text or completion.finish_reason is not None:
            if state.thought is not None:
                state.text += completion.new_text
            text, reasoning = self._split(state, state.text, completion.new_text,
                                          final=completion.finish_reason is not None)
            if new_ids or text or reasoning:
                frames.append(self._delta(completion.index, text, new_ids, logprobs, state, reasoning))
        if completion.finish_reason is not None:
            if self.final_only:
                frames.append(self._history_delta(completion.index, state))
            state.finished = True
            reason = self.finish_reason(completion.finish_reason, completion.stop_reason, state.num_tokens)
            frames.append(self._final(completion.index, reason, completion.stop_reason, state, metrics))
        return frames

    def finish_reason(self, reason: str, stop_reason: str | int | None, num_tokens: int) -> int:
        if reason == "length":
            at_max = num_tokens >= self.params.max_tokens
            return pb.FINISH_REASON_MAX_TOKENS if at_max else pb.FINISH_REASON_CONTEXT_LIMIT
        if reason == "abort":
            return pb.FINISH_REASON_CANCELLED
        if reason == FinishReason.CONSTRAINT_DEAD_END.value:
            return pb.FINISH_REASON_CONSTRAINT_DEAD_END
        if isinstance(stop_reason, str):
            return pb.FINISH_REASON_STOP_SEQUENCE
        if isinstance(stop_reason, int) and stop_reason in self.params.stop_token_ids:
            return pb.FINISH_REASON_STOP_TOKEN
        return pb.FINISH_REASON_EOS_TOKEN

    def _usage(self, state: _Completion) -> pb.Usage:
        return pb.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=state.num_tokens,
                        cached_tokens=self.cached_tokens)

    def _history_delta(self, index: int, state: _Completion) -> pb.GenerateResponse:
        """FINAL_ONLY's one Delta: the completion's whole history, read from its last output."""
        last = state.last
        if last is None:
            return self._delta(index, "", [], [], state)
        whole = last.text  # once, at the end
        text, reasoning = self._split(state, whole, whole, final=True)
        return self._delta(index, text, list(last.token_ids), list(last.logprobs), state, reasoning)

    @staticmethod
    def _split(state: _Completion, whole: str, new: str, final: bool) -> tuple[str, str]:
        """(the content's new text, the thought's new text) of a completion whose text is now `whole`."""
        if state.thought is None:
            return new, ""
        reasoning, content = state.thought.advance(whole, final)
        return state.thought.new_content(content), reasoning

    def _delta(self, index: int, text: str, token_ids: list[int], logprobs: list[TokenLogprob],
               state: _Completion, reasoning: str = "") -> pb.GenerateResponse:
        delta = pb.Delta(text=text, token_ids=token_ids, usage=self._usage(state), reasoning=reasoning)
        if self.params.logprobs is not None:
            delta.logprobs.extend(_token_logprob(lp) for lp in logprobs)
        return pb.GenerateResponse(index=index, delta=delta)

    def _final(self, index: int, reason: int, stop_reason: str | int | None, state: _Completion,
               metrics: RequestMetrics) -> pb.GenerateResponse:
        final = pb.Final(finish_reason=reason, usage=self._usage(state), timing=timing(metrics))
        if reason == pb.FINISH_REASON_STOP_SEQUENCE:
            final.stop_sequence = stop_reason
        elif reason == pb.FINISH_REASON_STOP_TOKEN:
            final.stop_token_id = stop_reason
        return pb.GenerateResponse(index=index, final=final)


def timing(metrics: RequestMetrics) -> pb.Timing:
    d = durations(metrics)
    return pb.Timing(queue_seconds=d.queue_s, time_to_first_token_seconds=d.time_to_first_token_s,
                     decode_seconds=d.decode_s, total_seconds=d.total_s, num_preemptions=d.num_preemptions)


def _token_logprob(lp: TokenLogprob) -> pb.TokenLogprob:
    out = pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                          top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
    if lp.rank is not None:
        out.rank = lp.rank
    return out
