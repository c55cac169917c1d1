"""pagedserve.v1's frames from engine outputs (service/v1/frames.py): each Delta carries what is new, and no stream
reads a completion's whole text per Delta (joined from its history on every read: quadratic over a long stream)."""

from __future__ import annotations

from stream_outputs import PROMPT, engine_outputs

from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.reasoning import REASONING_FORMATS
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.service.core.thought_reader import ThoughtReader
from pagedserve.service.v1.frames import FrameBuilder
from pagedserve.v1 import generate_pb2 as pb


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
    assert history.walks == 0  # the reader reads the text the builder grew from the pieces


def test_final_only_sends_the_whole_output_once():
    pieces = [" a", " b", " c"]
    outputs, _ = engine_outputs(pieces)
    builder = FrameBuilder("r", len(PROMPT), False, SamplingParams(max_tokens=3), pb.STREAM_MODE_FINAL_ONLY)
    frames = stream(builder, outputs)
    deltas = [f.delta for f in frames if f.WhichOneof("frame") == "delta"]
    assert [d.text for d in deltas] == [" a b c"] and list(deltas[0].token_ids) == [100, 101, 102]
