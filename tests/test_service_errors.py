"""Bad inputs: each gets INVALID_ARGUMENT naming the field, and the server keeps serving."""

from __future__ import annotations

import math

import grpc
import pytest
from service_fixtures import generate_raw, shared_server, stub  # noqa: F401 - fixtures are used by name

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import tokenize_pb2

VOCAB = 49152
CONTEXT = 512  # the shared server's --max-model-len
MAX_MESSAGE = 1 << 20  # the shared server's --max-message-bytes


def req(text: str | None = "Hello", **parts: object) -> pb.GenerateRequest:
    request = pb.GenerateRequest(**parts)
    if text is not None:
        request.text = text
    return request


def with_ids(ids: list[int]) -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    request.token_ids.ids.extend(ids)
    return request


def with_enum(value: int) -> pb.GenerateRequest:
    request = req()
    request.response.stream_mode = value  # proto3 enums are open: the class accepts any int32
    return request


def bad_utf8_stop() -> bytes:
    request = req(stopping=pb.StoppingOptions(stop_sequences=["ok", "@@"]))
    return request.SerializeToString().replace(b"@@", b"\xc3\x28")  # an invalid 2-byte sequence


def oversized() -> bytes:
    # Over the 1 MiB limit but under the transport cap (2x), so the servicer sees it and names the limit.
    return req("word " * (MAX_MESSAGE // 5 + 1000)).SerializeToString()


def sampling(**kw: object) -> pb.GenerateRequest:
    return req(sampling=pb.SamplingOptions(**kw))


def stopping(**kw: object) -> pb.GenerateRequest:
    return req(stopping=pb.StoppingOptions(**kw))


# (case id, request or raw bytes, field the error must name, a fragment of the explanation)
BAD_GENERATE = [
    ("negative temperature", sampling(temperature=-0.5), "sampling.temperature", ">= 0"),
    ("NaN temperature", sampling(temperature=math.nan), "sampling.temperature", "finite"),
    ("top_p zero", sampling(top_p=0.0), "sampling.top_p", "(0, 1]"),
    ("top_p above one", sampling(top_p=1.5), "sampling.top_p", "(0, 1]"),
    ("top_k below -1 (off)", sampling(top_k=-2), "sampling.top_k", ">= -1"),
    ("min_p above one", sampling(min_p=2.0), "sampling.min_p", "[0, 1]"),
    ("seed too large", sampling(seed=2**64 - 1), "sampling.seed", "2**63"),
    ("logit_bias outside vocab", sampling(logit_bias={VOCAB + 5: 1.0}), "sampling.logit_bias", "vocabulary"),
    ("n zero", req(n=0), "n", ">= 1"),
    ("n above the limit", req(n=1000), "n", "<= 64"),
    ("greedy with n > 1", req(n=2, sampling=pb.SamplingOptions(temperature=0)), "n", "temperature"),
    ("max_new_tokens zero", stopping(max_new_tokens=0), "stopping.max_new_tokens", ">= 1"),
    ("max_new_tokens over the context", stopping(max_new_tokens=CONTEXT + 1), "stopping.max_new_tokens",
     f"{CONTEXT}"),
    ("min above max", stopping(max_new_tokens=4, min_new_tokens=8), "stopping.min_new_tokens", "exceeds"),
    ("stop token outside vocab", stopping(stop_token_ids=[VOCAB]), "stopping.stop_token_ids", "vocabulary"),
    ("zero time limit", stopping(time_limit_ms=0), "stopping.time_limit_ms", ">= 1"),
    ("empty stop string", stopping(stop_sequences=[""]), "stopping.stop_sequences", "non-empty"),
    ("too many logprobs", req(response=pb.ResponseOptions(logprobs=1000)), "response.logprobs", "<= 20"),
    ("no input", req(None), "input", "text, token_ids or chat"),
    ("empty text", req(""), "text", "empty"),
    ("empty token ids", with_ids([]), "token_ids.ids", "empty"),
    ("token id outside vocab", with_ids([1, 2, VOCAB + 7]), "token_ids.ids[2]", "vocabulary"),
    ("too-long text prompt", req("hello " * (CONTEXT + 50)), "text", f"context is {CONTEXT}"),
    ("too-long token prompt", with_ids([42] * (CONTEXT + 1)), "token_ids.ids", f"context is {CONTEXT}"),
    ("truncate to zero", req(truncate_input_tokens=0), "truncate_input_tokens", ">= 1"),
    ("unknown stream mode", with_enum(7), "response.stream_mode", "unknown enum value 7"),
    ("invalid UTF-8 in a stop string", bad_utf8_stop(), "stopping.stop_sequences[1]", "UTF-8"),
    ("oversized message", oversized(), "request", f"{MAX_MESSAGE} bytes"),
    ("garbage bytes", b"\xff\xff\xff\xff", "request", "parse"),
]


@pytest.fixture(scope="module")
def channel(shared_server) -> grpc.Channel:  # noqa: F811
    options = [("grpc.max_send_message_length", 4 * MAX_MESSAGE)]
    with grpc.insecure_channel(shared_server.target, options=options) as ch:
        yield ch


def assert_serving(channel: grpc.Channel) -> None:
    request = pb.GenerateRequest(text="Hi", stopping=pb.StoppingOptions(max_new_tokens=2, ignore_eos=True))
    frames = list(stub(channel).Generate(request, timeout=60))
    assert frames[-1].final.usage.completion_tokens == 2


@pytest.mark.parametrize("case, request_or_bytes, field, explanation", BAD_GENERATE, ids=[c[0] for c in BAD_GENERATE])
def test_bad_generate_input_is_invalid_argument_naming_the_field(channel, case, request_or_bytes, field,
                                                                  explanation):
    payload = request_or_bytes if isinstance(request_or_bytes, bytes) else request_or_bytes.SerializeToString()
    with pytest.raises(grpc.RpcError) as info:
        generate_raw(channel, payload)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    details = info.value.details()
    assert details.startswith(f"{field}: "), details
    assert explanation in details, details


def test_server_keeps_serving_after_every_bad_input(channel):
    for _, request_or_bytes, _, _ in BAD_GENERATE:
        payload = request_or_bytes if isinstance(request_or_bytes, bytes) else request_or_bytes.SerializeToString()
        with pytest.raises(grpc.RpcError):
            generate_raw(channel, payload)
    assert_serving(channel)


def test_bad_tokenize_input_is_invalid_argument(channel):
    payload = tokenize_pb2.TokenizeRequest(text="@@").SerializeToString().replace(b"@@", b"\xff\xfe")
    call = channel.unary_unary("/pagedserve.v1.GenerationService/Tokenize", request_serializer=None,
                               response_deserializer=tokenize_pb2.TokenizeResponse.FromString)
    with pytest.raises(grpc.RpcError) as info:
        call(payload, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("text: ")
    assert_serving(channel)


def test_message_beyond_the_transport_cap_is_refused_and_the_server_survives(channel):
    huge = req("x" * (3 * MAX_MESSAGE)).SerializeToString()
    with pytest.raises(grpc.RpcError) as info:
        generate_raw(channel, huge)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_serving(channel)
