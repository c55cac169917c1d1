"""pagedserve.v1's frames from engine outputs (service/v1/frames.py): each Delta carries what is new, and a plain
stream never reads a completion's whole text (joined from its history on every read: quadratic over a long stream)."""

from __future__ import annotations

from pagedserve.engine.outputs import CompletionOutput, OutputHistory, RequestMetrics, RequestOutput
from pagedserve.engine.reasoning import REASONING_FORMATS
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.service.core.thought_reader import ThoughtReader
from pagedserve.service.v1.frames import FrameBuilder
from pagedserve.v1 import generate_pb2 as pb

PROMPT = (1, 2, 3)
METRICS = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.0, first_token_time=1.5, finished_time=None,
                         num_preemptions=0, num_cached_tokens=0)


class CountedPieces(list):
    """A sequence's text pieces, counting how often the whole list is walked (a join of the whole text)."""

    walks = 0

    def __iter__(self):
        self.walks += 1
        return super().__iter__()


def engine_outputs(pieces: list[str]) -> tuple[list[RequestOutput], CountedPieces]:
    """One output per piece, as the engine makes them: the new piece, the history by reference."""
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
        outputs.append(RequestOutput("r", PROMPT, (completion,), done, METRICS))
    return outputs, history


def stream(builder: FrameBuilder, outputs: list[RequestOutput]) -> list[pb.GenerateResponse]:
    return [frame for out in outputs for frame in builder.frames(out)]


def test_a_plain_stream_sends_each_piece_and_never_joins_the_whole_text():
    pieces = [f" word{i}" for i in range(300)]
    outputs, history = engine_outputs(pieces)
    builder = FrameBuilder("r", len(PROMPT), False, SamplingParams(max_tokens=300), pb.STREAM_MODE_DELTAS)
    frames = stream(builder, outputs)
    deltas = [f.delta for f in frames if f.WhichOneof("frame") == "delta"]
    assert "".join(d.text for d in deltas) == "".join(pieces) and len(deltas) == 300
    assert [t for d in deltas for t in d.token_ids] == list(range(100, 400))
    assert frames[-1].final.finish_reason == pb.FINISH_REASON_MAX_TOKENS
    assert history.walks == 0


def test_a_thought_reader_still_splits_the_whole_text():
    pieces = ["<think>", "plan", " it", "</think>", "the", " answer"]
    outputs, history = engine_outputs(pieces)
    reader = ThoughtReader(REASONING_FORMATS.get("deepseek_r1"))
    builder = FrameBuilder("r", len(PROMPT), False, SamplingParams(max_tokens=6), pb.STREAM_MODE_DELTAS, reader)
    deltas = [f.delta for f in stream(builder, outputs) if f.WhichOneof("frame") == "delta"]
    assert "".join(d.reasoning for d in deltas) == "plan it"
    assert "".join(d.text for d in deltas) == "the answer"
    assert history.walks > 0


def test_final_only_sends_the_whole_output_once():
    pieces = [" a", " b", " c"]
    outputs, _ = engine_outputs(pieces)
    builder = FrameBuilder("r", len(PROMPT), False, SamplingParams(max_tokens=3), pb.STREAM_MODE_FINAL_ONLY)
    frames = stream(builder, outputs)
    deltas = [f.delta for f in frames if f.WhichOneof("frame") == "delta"]
    assert [d.text for d in deltas] == [" a b c"] and list(deltas[0].token_ids) == [100, 101, 102]
