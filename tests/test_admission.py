"""One request, checked once: every front end (offline, pagedserve.v1, OpenAI HTTP, vllm.grpc.engine) admits a
request through engine/admission.py exactly once, tokenizes its prompt once, and nothing downstream checks it again.

The servers here are the real ones (grpc.aio with both servicers, uvicorn with the OpenAI app) on 127.0.0.1 in this
process, over a tiny random Llama, so the checks can be counted by wrapping the real functions."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Awaitable, Callable

import grpc
import pytest
from chat_templates import QWEN2
from conftest import make_tiny_model
from grpc_health.v1._async import HealthServicer
from pagedserve.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from pagedserve.engine.admission import Admission, ModelLimits
from pagedserve.engine.errors import CapacityError, InvalidRequestError
from pagedserve.engine.loading.chat_template import ChatMessage
from pagedserve.engine.loading.tokenizer import Tokenizer
from pagedserve.engine.requests import TRUNCATE_TO_CONTEXT, ChatPrompt, GenerationRequest, TextPrompt, TokensPrompt
from pagedserve.service.core.context import ServingContext
from pagedserve.service.core.lifecycle import ServingState
from pagedserve.service.core.metrics import ServiceMetrics
from pagedserve.service.openai.http_server import HttpServer
from pagedserve.service.router.vllm_servicer import VllmEngineServicer
from pagedserve.service.v1.servicer import GenerationServicer
from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generation_service_pb2_grpc
from service_fixtures import off_main_thread
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vgrpc

CONTEXT = 128
NEW_TOKENS = 4
MAX_BYTES = 1 << 20


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory) -> LLMEngine:
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-admission"))
    config = EngineConfig(model=str(path), dtype="float32", max_model_len=CONTEXT, kv_cache_memory=4 << 20)
    return off_main_thread(LLMEngine, config)


@pytest.fixture
def checks(monkeypatch) -> dict[str, int]:
    """Counts the real admission, vocabulary check and prompt tokenization, wherever they are called from."""
    counts = {"admit": 0, "check_vocab": 0, "encode": 0}
    for owner, name in ((Admission, "admit"), (SamplingParams, "check_vocab"), (Tokenizer, "encode")):
        monkeypatch.setattr(owner, name, _counting(getattr(owner, name), counts, name))
    return counts


def _counting(fn: Callable, counts: dict[str, int], key: str) -> Callable:
    def counted(*args, **kwargs):
        counts[key] += 1
        return fn(*args, **kwargs)

    return counted


async def _serve(engine: LLMEngine, call: Callable[[int, int], Awaitable[int]],
                 metrics: ServiceMetrics | None = None) -> int:
    """Both gRPC services and the OpenAI app on one AsyncEngine, as `pagedserve serve` wires them; returns what
    `call(grpc_port, http_port)` returns (the number of tokens it got back)."""
    front = AsyncEngine(engine.config, engine=engine)
    await front.start()
    state = ServingState(HealthServicer())
    metrics = metrics or ServiceMetrics("tiny", front.stats)
    serving = ServingContext(state, metrics, "tiny")
    serving.attach(front)
    servicer = GenerationServicer(serving, MAX_BYTES)
    router = VllmEngineServicer(serving, MAX_BYTES)
    router.listen(front)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((servicer.rpc_handler(), router.rpc_handler()))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    http = HttpServer(serving, "127.0.0.1", 0, MAX_BYTES)
    await http.start()
    await state.mark_serving()
    try:
        return await call(port, http.port)
    finally:
        await http.stop()
        await server.stop(None)
        await front.shutdown()


async def _v1(port: int, _: int, request: pb.GenerateRequest) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        frames = [f async for f in generation_service_pb2_grpc.GenerationServiceStub(channel).Generate(request)]
    return frames[-1].final.usage.completion_tokens


async def _router(port: int, _: int, request: vpb.GenerateRequest) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        replies = [r async for r in vgrpc.VllmEngineStub(channel).Generate(request)]
    return replies[-1].complete.completion_tokens


async def _openai(_: int, http_port: int, path: str, body: dict) -> int:
    def post() -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=120)
        try:
            conn.request("POST", path, json.dumps(body).encode(), {"content-type": "application/json"})
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    status, reply = await asyncio.to_thread(post)
    assert status == 200, reply
    return reply["usage"]["completion_tokens"]


STOPPING = pb.StoppingOptions(max_new_tokens=NEW_TOKENS, ignore_eos=True)
GREEDY = pb.SamplingOptions(temperature=0)
ROUTER_SAMPLING = vpb.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
USER = [{"role": "user", "content": "Hello there"}]
FRONT_ENDS = {
    "v1-text": lambda p, h: _v1(p, h, pb.GenerateRequest(text="Hello there", sampling=GREEDY, stopping=STOPPING)),
    "v1-chat": lambda p, h: _v1(p, h, pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Hello there")], chat_template=QWEN2),
        sampling=GREEDY, stopping=STOPPING)),
    "openai-completions": lambda p, h: _openai(p, h, "/v1/completions", {
        "prompt": "Hello there", "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}),
    "openai-chat": lambda p, h: _openai(p, h, "/v1/chat/completions", {
        "messages": USER, "chat_template": QWEN2, "max_tokens": NEW_TOKENS, "temperature": 0,
        "ignore_eos": True}),
    "vllm-router": lambda p, h: _router(p, h, vpb.GenerateRequest(
        request_id="once", text="Hello there", sampling_params=ROUTER_SAMPLING)),
}


@pytest.mark.parametrize("front_end", list(FRONT_ENDS))
def test_each_front_end_admits_a_request_once(tiny_engine, checks, front_end):
    tokens = asyncio.run(_serve(tiny_engine, FRONT_ENDS[front_end]))
    assert tokens == NEW_TOKENS
    assert checks == {"admit": 1, "check_vocab": 1, "encode": 1}, checks
    assert not tiny_engine.has_unfinished_requests() and tiny_engine.block_manager.num_used_blocks == 0


def test_the_offline_api_admits_once_and_the_engine_never_again(tiny_engine, checks):
    tiny_engine.add_request("offline", "Hello there", SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                      ignore_eos=True))
    assert checks == {"admit": 1, "check_vocab": 1, "encode": 1}
    outputs = []
    while tiny_engine.has_unfinished_requests():
        outputs += tiny_engine.step()
    assert checks == {"admit": 1, "check_vocab": 1, "encode": 1}
    assert sum(len(c.new_token_ids) for o in outputs for c in o.outputs) == NEW_TOKENS
    assert outputs[-1].outputs[0].token_ids == tuple(t for o in outputs for t in o.outputs[0].new_token_ids)


# --- the rules themselves ---------------------------------------------------------------------------------------


def _admit(engine: LLMEngine, prompt, **kw) -> object:
    params = kw.pop("params", SamplingParams(temperature=0))
    return engine.admission.admit(GenerationRequest(prompt, params, **kw))


def test_defaults_fit_the_context_and_a_clients_max_tokens_must(tiny_engine):
    prompt = TokensPrompt(tuple(range(10, 10 + CONTEXT - 5)))  # leaves room for 5 new tokens
    assert _admit(tiny_engine, prompt, params=SamplingParams(max_tokens=None)).params.max_tokens == 5
    default = _admit(tiny_engine, prompt, params=SamplingParams(max_tokens=16, min_tokens=8),
                     max_tokens_is_default=True)
    assert (default.params.max_tokens, default.params.min_tokens) == (5, 5)
    with pytest.raises(InvalidRequestError) as info:
        _admit(tiny_engine, prompt, params=SamplingParams(max_tokens=16))
    assert info.value.field == "max_tokens" and "at most 5" in info.value.message


def test_truncation_keeps_the_tail(tiny_engine):
    ids = tuple(range(10, 10 + 2 * CONTEXT))
    kept = _admit(tiny_engine, TokensPrompt(ids), truncate_prompt_tokens=7)
    assert kept.prompt_token_ids == ids[-7:] and kept.truncated
    fitted = _admit(tiny_engine, TokensPrompt(ids), truncate_prompt_tokens=TRUNCATE_TO_CONTEXT,
                    params=SamplingParams(max_tokens=None))
    assert len(fitted.prompt_token_ids) == CONTEXT - 1 and fitted.params.max_tokens == 1
    with pytest.raises(InvalidRequestError) as info:
        _admit(tiny_engine, TokensPrompt(ids), truncate_prompt_tokens=0)
    assert info.value.field == "truncate_prompt_tokens"


@pytest.mark.parametrize(("prompt", "field", "fragment"), [
    (TextPrompt(""), "prompt", "empty"),
    (TokensPrompt(()), "prompt_token_ids", "empty"),
    (TokensPrompt((1, 49152)), "prompt_token_ids[1]", "vocabulary"),
    (TokensPrompt((5,) * CONTEXT), "prompt_token_ids", f"context is {CONTEXT}"),
    (ChatPrompt((ChatMessage("wizard", "x"),)), "messages[0].role", "unknown role"),
])
def test_prompt_errors_name_the_field(tiny_engine, prompt, field, fragment):
    with pytest.raises(InvalidRequestError) as info:
        _admit(tiny_engine, prompt)
    assert info.value.field == field and fragment in info.value.message


def test_a_request_larger_than_the_kv_cache_is_a_capacity_error(tiny_engine):
    small = Admission(ModelLimits(tiny_engine.runner.vocab_size, CONTEXT, 32), tiny_engine.tokenizer)
    with pytest.raises(CapacityError) as info:
        small.admit(GenerationRequest(TokensPrompt((5,) * 30), SamplingParams(max_tokens=10)))
    assert info.value.field == "max_tokens" and "KV cache" in info.value.message


LONG_TEXT = "hello there " * 1500  # 18,000 characters: over service/core/admit.py's 16 KiB, admitted off the loop


async def _openai_status(_: int, http_port: int, body: dict) -> int:
    def post() -> int:
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
            response = conn.getresponse()
            response.read()
            return response.status
        finally:
            conn.close()

    return await asyncio.to_thread(post)


LONG_REQUESTS = {
    "v1": lambda p, h: _v1(p, h, pb.GenerateRequest(
        text=LONG_TEXT, truncate_input_tokens=16, sampling=GREEDY, stopping=STOPPING)),
    "vllm-router": lambda p, h: _router(p, h, vpb.GenerateRequest(request_id="long", text=LONG_TEXT,
        sampling_params=vpb.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                                           truncate_prompt_tokens=16))),
    # No truncation in the OpenAI API: the prompt is over the context, so the reply is a 400; where it was admitted
    # is what counts here.
    "openai": lambda p, h: _openai_status(p, h, {"prompt": LONG_TEXT, "max_tokens": NEW_TOKENS}),
}


@pytest.mark.parametrize("front_end", list(LONG_REQUESTS))
def test_every_front_end_admits_a_long_prompt_off_the_event_loop(tiny_engine, monkeypatch, front_end):
    threads = []
    admit = Admission.admit

    def recording(self, request):
        threads.append(threading.current_thread())
        return admit(self, request)

    monkeypatch.setattr(Admission, "admit", recording)
    result = asyncio.run(_serve(tiny_engine, LONG_REQUESTS[front_end]))  # the event loop runs on this thread
    assert result == (400 if front_end == "openai" else NEW_TOKENS)
    assert len(threads) == 1 and threads[0] is not threading.current_thread(), threads


async def _two_at_once(port: int, http_port: int, first: Callable, second: Callable) -> list:
    return await asyncio.gather(first(port, http_port), second(port, http_port), return_exceptions=True)


def test_a_v1_request_id_may_be_reused_while_it_runs(tiny_engine):
    slow = pb.StoppingOptions(max_new_tokens=24, ignore_eos=True)
    v1 = lambda p, h: _v1(p, h, pb.GenerateRequest(  # noqa: E731
        request_id="retry-7", text="Hello there", sampling=GREEDY, stopping=slow))
    assert asyncio.run(_serve(tiny_engine, lambda p, h: _two_at_once(p, h, v1, v1))) == [24, 24]
    assert not tiny_engine.has_unfinished_requests() and tiny_engine.block_manager.num_used_blocks == 0


def test_a_router_id_refused_as_in_flight_leaves_the_request_holding_it_alone(tiny_engine):
    """A router sends a second request under an id still running (a retry that raced its original): the second is
    refused naming request_id, and the first runs to its end. The refused call's clean-up used to abort by that id,
    i.e. the other request (found by the fuzz campaign, tests/test_fuzz_vllm.py)."""
    slow = vpb.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def call(port: int, _: int) -> tuple[list, grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            engine = vgrpc.VllmEngineStub(channel)
            first = engine.Generate(vpb.GenerateRequest(
                request_id="dup-1", tokenized=vpb.TokenizedInput(input_ids=[5, 6, 7]), sampling_params=slow,
                stream=True))
            replies = [await first.read()]  # the first is running: its id is taken
            try:
                [r async for r in engine.Generate(vpb.GenerateRequest(
                    request_id="dup-1", tokenized=vpb.TokenizedInput(input_ids=[8]), sampling_params=slow))]
                code, details = grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details()
            while (reply := await first.read()) is not grpc.aio.EOF:
                replies.append(reply)
        return replies, code, details

    replies, code, details = asyncio.run(_serve(tiny_engine, call))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request_id: "), (code, details)
    complete = replies[-1].complete
    assert (complete.finish_reason, complete.completion_tokens) == ("length", 24), replies[-1]
    assert not tiny_engine.has_unfinished_requests() and tiny_engine.block_manager.num_used_blocks == 0


def test_the_engine_refuses_an_id_in_flight_once_for_every_front_end(tiny_engine):
    """The one uniqueness check (AsyncEngine): the step loop is not started, so the first request stays in flight."""
    async def run() -> None:
        front = AsyncEngine(tiny_engine.config, engine=tiny_engine)
        admitted = front.admit(GenerationRequest(TextPrompt("Hello there"), SamplingParams(max_tokens=NEW_TOKENS)))
        first = front.stream("twice", admitted)
        pending = asyncio.ensure_future(anext(first))
        await asyncio.sleep(0)  # the first registers its id
        with pytest.raises(InvalidRequestError, match="already in flight") as err:
            await anext(front.stream("twice", admitted))
        assert err.value.field == "request_id"
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await first.aclose()
        again = front.stream("twice", admitted)  # released: the same id is accepted again at once
        pending = asyncio.ensure_future(anext(again))
        await asyncio.sleep(0)
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await again.aclose()
        assert front.num_unfinished == 0

    asyncio.run(run())


def test_a_request_the_engine_fails_before_its_first_token_counts_as_finished_with_error(tiny_engine, monkeypatch):
    """vLLM counts a request its engine failed under vllm:request_success{finished_reason="error"}; one that failed
    before its first output (here: its own penalty pass raised) was missing from the count, which held only the
    requests the engine had answered. The caller gets INTERNAL; a request after it is served and counted."""
    from pagedserve.engine.runner.sampler import Sampler

    process_row = Sampler._process_row

    def failing(self, row, seq, in_flight):
        if seq.params.repetition_penalty > 1.2:  # the proto's float32 1.3
            raise IndexError("injected")
        return process_row(self, row, seq, in_flight)

    monkeypatch.setattr(Sampler, "_process_row", failing)
    metrics = ServiceMetrics("tiny", lambda: None)
    victim = pb.GenerateRequest(text="Hello there", sampling=pb.SamplingOptions(temperature=0, repetition_penalty=1.3),
                                stopping=STOPPING)
    plain = pb.GenerateRequest(text="Hello there", sampling=GREEDY, stopping=STOPPING)

    async def call(port: int, _: int) -> tuple[grpc.StatusCode, int]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                [f async for f in stub.Generate(victim)]
            frames = [f async for f in stub.Generate(plain)]
        return failed.value.code(), frames[-1].final.usage.completion_tokens

    code, tokens = asyncio.run(_serve(tiny_engine, call, metrics))
    assert code == grpc.StatusCode.INTERNAL and tokens == NEW_TOKENS

    def finished(reason: str) -> float | None:
        return metrics.registry.get_sample_value("vllm:request_success_total",
                                                 {"model_name": "tiny", "finished_reason": reason})

    assert finished("error") == 1 and finished("length") == 1
    assert tiny_engine.block_manager.num_used_blocks == 0 and not tiny_engine.has_unfinished_requests()
