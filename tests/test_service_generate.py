"""Generate over a real socket: streamed deltas against the offline engine, frame order, options, metadata."""

from __future__ import annotations

import grpc
import pytest
from service_fixtures import model_info, off_main_thread, shared_server, stub  # noqa: F401 - fixtures by name

from pagedserve.engine import LLM, RequestOutput, SamplingParams
from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import tokenize_pb2

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def channel(shared_server) -> grpc.Channel:  # noqa: F811
    with grpc.insecure_channel(shared_server.target) as ch:
        yield ch


@pytest.fixture(scope="module")
def offline() -> dict[str, RequestOutput]:
    """Greedy outputs of the offline API (same context limit as the server), 24 tokens per prompt."""
    llm = LLM(max_model_len=512, kv_cache_memory=32 << 20, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = off_main_thread(llm.generate, PROMPTS, params)
    return dict(zip(PROMPTS, outputs))


def greedy_request(prompt: str, max_new_tokens: int, **stopping: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, sampling=pb.SamplingOptions(temperature=0),
                              stopping=pb.StoppingOptions(max_new_tokens=max_new_tokens, **stopping))


def frames_of(channel: grpc.Channel, request: pb.GenerateRequest, **kwargs: object) -> list[pb.GenerateResponse]:
    return list(stub(channel).Generate(request, timeout=120, **kwargs))


def kinds(frames: list[pb.GenerateResponse]) -> list[str]:
    return [f.WhichOneof("frame") for f in frames]


def delta_tokens(frames: list[pb.GenerateResponse]) -> list[int]:
    return [t for f in frames if f.WhichOneof("frame") == "delta" for t in f.delta.token_ids]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_deltas_concatenate_to_offline_greedy_output(channel, offline, prompt):
    frames = frames_of(channel, greedy_request(prompt, 24, ignore_eos=True))
    expected = offline[prompt]
    deltas = [f.delta for f in frames if f.WhichOneof("frame") == "delta"]
    assert len(deltas) > 1, "one delta per step, not one blob"
    assert "".join(d.text for d in deltas) == expected.outputs[0].text
    assert [t for d in deltas for t in d.token_ids] == list(expected.outputs[0].token_ids)
    started, final = frames[0].started, frames[-1].final
    assert kinds(frames)[0] == "started" and kinds(frames)[-1] == "final"
    assert started.prompt_tokens == len(expected.prompt_token_ids)
    assert final.finish_reason == pb.FINISH_REASON_MAX_TOKENS
    assert final.usage.completion_tokens == 24 and final.usage.prompt_tokens == started.prompt_tokens
    assert final.timing.total_seconds >= final.timing.time_to_first_token_seconds > 0


def test_token_id_input_matches_text_input(channel):
    text_frames = frames_of(channel, greedy_request(PROMPTS[0], 8))
    ids = stub(channel).Tokenize(tokenize_pb2.TokenizeRequest(text=PROMPTS[0]), timeout=30).token_ids
    request = greedy_request("", 8)
    request.token_ids.ids.extend(ids)
    id_frames = frames_of(channel, request)
    tokens = [delta_tokens(frames) for frames in (text_frames, id_frames)]
    assert tokens[0] == tokens[1] and len(tokens[0]) > 0


def test_stop_sequence_ends_the_stream_and_is_reported(channel, offline):
    text = offline[PROMPTS[0]].outputs[0].text
    stop = text.strip().split()[1]  # the second word of the greedy continuation
    frames = frames_of(channel, greedy_request(PROMPTS[0], 24, stop_sequences=[stop]))
    final = frames[-1].final
    streamed = "".join(f.delta.text for f in frames if f.WhichOneof("frame") == "delta")
    assert final.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert final.stop_sequence == stop
    assert stop not in streamed and text.startswith(streamed)


def test_stop_token_id_is_reported(channel, offline):
    third = offline[PROMPTS[1]].outputs[0].token_ids[2]
    frames = frames_of(channel, greedy_request(PROMPTS[1], 12, stop_token_ids=[third], ignore_eos=True))
    assert frames[-1].final.finish_reason == pb.FINISH_REASON_STOP_TOKEN
    assert frames[-1].final.stop_token_id == third


def test_n_completions_each_get_deltas_and_a_final(channel):
    request = pb.GenerateRequest(text=PROMPTS[2], n=3, sampling=pb.SamplingOptions(temperature=1.0, seed=7),
                                 stopping=pb.StoppingOptions(max_new_tokens=6, ignore_eos=True))
    frames = frames_of(channel, request)
    assert kinds(frames).count("started") == 1 and frames[0].started.seed == 7
    finals = {f.index: f.final for f in frames if f.WhichOneof("frame") == "final"}
    assert sorted(finals) == [0, 1, 2]
    for index in range(3):
        tokens = [t for f in frames if f.index == index and f.WhichOneof("frame") == "delta" for t in f.delta.token_ids]
        assert len(tokens) == finals[index].usage.completion_tokens == 6
        last = max(i for i, f in enumerate(frames) if f.index == index)
        assert frames[last].WhichOneof("frame") == "final", "a completion's Final is its last frame"


def test_seeded_sampling_is_reproducible_over_the_wire(channel):
    request = pb.GenerateRequest(text=PROMPTS[2], sampling=pb.SamplingOptions(temperature=0.9, top_k=50, seed=1234),
                                 stopping=pb.StoppingOptions(max_new_tokens=10, ignore_eos=True))
    runs = [delta_tokens(frames_of(channel, request)) for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 10


def test_top_k_minus_one_over_the_wire_is_off(channel):
    """A Go or Java caller used to vLLM sends top_k = -1 for "off": the same seeded tokens as leaving it unset."""
    def tokens(**sampling: object) -> list[int]:
        request = pb.GenerateRequest(text=PROMPTS[2], sampling=pb.SamplingOptions(temperature=0.9, seed=77, **sampling),
                                     stopping=pb.StoppingOptions(max_new_tokens=10, ignore_eos=True))
        return delta_tokens(frames_of(channel, request))

    unset = tokens()
    assert tokens(top_k=-1) == unset and len(unset) == 10


def test_final_only_mode_sends_one_delta_with_the_whole_output(channel):
    streamed = frames_of(channel, greedy_request(PROMPTS[0], 10, ignore_eos=True))
    request = greedy_request(PROMPTS[0], 10, ignore_eos=True)
    request.response.stream_mode = pb.STREAM_MODE_FINAL_ONLY
    final_only = frames_of(channel, request)
    assert kinds(final_only) == ["started", "delta", "final"]
    assert final_only[1].delta.text == "".join(f.delta.text for f in streamed if f.WhichOneof("frame") == "delta")
    assert len(final_only[1].delta.token_ids) == 10


def test_logprobs_come_with_each_token(channel):
    request = greedy_request(PROMPTS[0], 5, ignore_eos=True)
    request.response.logprobs = 3
    frames = frames_of(channel, request)
    for f in frames:
        if f.WhichOneof("frame") == "delta":
            assert [lp.token_id for lp in f.delta.logprobs] == list(f.delta.token_ids)
            for lp in f.delta.logprobs:
                assert len(lp.top) == 3 and lp.logprob <= 0
                # greedy: the chosen token is the most likely one
                assert lp.top[0].token_id == lp.token_id and lp.top[0].logprob >= lp.top[-1].logprob


def test_request_id_from_field_or_metadata_is_echoed(channel):
    call = stub(channel).Generate(pb.GenerateRequest(request_id="req-field-1", text="Hi",
                                                     stopping=pb.StoppingOptions(max_new_tokens=2)), timeout=60)
    frames = list(call)
    assert frames[0].started.request_id == "req-field-1"
    assert dict(call.initial_metadata())["x-request-id"] == "req-field-1"
    call = stub(channel).Generate(greedy_request("Hi", 2), metadata=(("x-request-id", "req-meta-2"),), timeout=60)
    assert list(call)[0].started.request_id == "req-meta-2"
    assert dict(call.initial_metadata())["x-request-id"] == "req-meta-2"
    call = stub(channel).Generate(greedy_request("Hi", 2), timeout=60)
    generated = list(call)[0].started.request_id
    assert generated and dict(call.initial_metadata())["x-request-id"] == generated


def test_truncate_input_tokens_keeps_the_tail(channel):
    request = greedy_request(PROMPTS[2], 2)
    request.truncate_input_tokens = 3
    started = frames_of(channel, request)[0].started
    assert started.prompt_tokens == 3 and started.truncated


def test_time_limit_finishes_with_time_limit_reason(channel):
    request = greedy_request(PROMPTS[0], 400, ignore_eos=True, time_limit_ms=1)
    frames = frames_of(channel, request)
    assert frames[-1].final.finish_reason == pb.FINISH_REASON_TIME_LIMIT
    assert frames[-1].final.usage.completion_tokens < 400


def test_tokenize_offsets_are_utf8_byte_spans(channel):
    text = "héllo wörld"
    response = stub(channel).Tokenize(tokenize_pb2.TokenizeRequest(text=text, return_offsets=True), timeout=30)
    data = text.encode()
    assert len(response.offsets) == len(response.token_ids) > 0
    assert b"".join(data[o.start:o.end] for o in response.offsets) == data


def test_model_info_describes_the_model_and_its_cache(channel):
    info = model_info(channel)
    assert info.architecture == "LlamaForCausalLM"
    assert info.max_context_length == 512 and info.block_size == 16
    assert info.vocab_size == 49152 and info.kv_cache_dtype and info.dtype == "float32"
    assert info.kv_cache.total_blocks > 0
    assert info.kv_cache.free_blocks + info.kv_cache.used_blocks <= info.kv_cache.total_blocks
    assert info.limits.max_message_bytes == 1 << 20
