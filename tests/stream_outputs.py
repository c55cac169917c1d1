"""Engine outputs made by hand for the front ends' stream renderers (pagedserve.v1 frames, OpenAI chunks): one
output per text piece, the history by reference as the engine hands it, and a history whose whole text counts how
often it is joined (a renderer that joins it for every chunk is quadratic over a long stream)."""

from __future__ import annotations

from pagedserve.engine.outputs import CompletionOutput, OutputHistory, RequestMetrics, RequestOutput

PROMPT = (1, 2, 3)
METRICS = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.0, first_token_time=1.5, finished_time=None,
                         num_preemptions=0, num_cached_tokens=0)


class CountedPieces(list):
    """A sequence's text pieces, counting how often the whole list is walked (a join of the whole text)."""

    walks = 0

    def __iter__(self):
        self.walks += 1
        return super().__iter__()


def engine_outputs(pieces: list[str], request_id: str = "r") -> tuple[list[RequestOutput], CountedPieces]:
    """One output per piece, the last one finished ("length"); token ids 100, 101, ..."""
    tokens, history, outputs, length = list(PROMPT), CountedPieces(), [], 0
    for i, piece in enumerate(pieces):
        tokens.append(100 + i)
        history.append(piece)
        length += len(piece)
        done = i == len(pieces) - 1
        completion = CompletionOutput(
            index=0, new_text=piece, new_token_ids=(100 + i,), new_logprobs=(), num_tokens=i + 1,
            finish_reason="length" if done else None, stop_reason=None,
            history=OutputHistory(tokens, len(PROMPT), [], 0, history, length))
        outputs.append(RequestOutput(request_id, PROMPT, (completion,), done, METRICS))
    return outputs, history
