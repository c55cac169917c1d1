"""vLLM's cache_salt: requests share prefix-cache blocks only with requests of the same salt, on the engine, over
OpenAI HTTP and over pagedserve.v1; a bad salt is refused naming the field."""

from __future__ import annotations

import pytest
from service_fixtures import shared_server  # noqa: F401 - fixture by name
from test_openai_http_errors import COMPLETIONS, post

from pagedserve.client import Client, ClientError
from pagedserve.engine import SamplingParams
from pagedserve.engine.errors import InvalidRequestError

# Long enough for whole blocks; each test its own text, so no other test's blocks can be found.
def text(tag: str) -> str:
    return f"A cache salt keeps one tenant's prompts from another's: {tag}. " * 6
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def _run(engine, request_id: str, prompt: str, salt: str | None):
    engine.add_request(request_id, prompt, GREEDY, cache_salt=salt)
    finished = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished = out
    return finished.metrics.num_cached_tokens, finished.outputs[0].token_ids


def test_only_the_same_salt_finds_the_blocks(llm_fp32):
    engine, prompt = llm_fp32.engine, text("engine")
    first = _run(engine, "salt-1", prompt, "tenant-a")
    assert first[0] == 0
    other, none = _run(engine, "salt-2", prompt, "tenant-b"), _run(engine, "salt-3", prompt, None)
    assert other[0] == 0 and none[0] == 0  # another salt, and no salt, compute it all again
    same = _run(engine, "salt-4", prompt, "tenant-a")
    assert same[0] >= 32 and same[1] == first[1] == other[1] == none[1]
    assert _run(engine, "salt-5", prompt, None)[0] >= 32  # unsalted requests still share among themselves
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("salt", ["", 7, "x" * 1025])
def test_a_bad_salt_names_the_field(llm_fp32, salt):
    with pytest.raises(InvalidRequestError) as err:
        llm_fp32.engine.add_request("bad-salt", "Hi", GREEDY, cache_salt=salt)
    assert err.value.field == "cache_salt"


def test_openai_cache_salt(shared_server):  # noqa: F811
    def cached(salt):
        body = {"prompt": text("http"), "max_tokens": 2, "temperature": 0, **({"cache_salt": salt} if salt else {})}
        status, reply = post(shared_server.http_port, COMPLETIONS, body)
        assert status == 200, reply
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("a") == 0 and cached("b") == 0 and cached(None) == 0
    assert cached("a") >= 32
    status, reply = post(shared_server.http_port, COMPLETIONS, {"prompt": "x", "cache_salt": ""})
    assert status == 400 and reply["error"]["param"] == "cache_salt", reply


def test_v1_cache_salt(shared_server):  # noqa: F811
    with Client(shared_server.target, timeout=120) as client:
        def cached(salt):
            stream = client.generate(text("grpc"), temperature=0, max_new_tokens=2, cache_salt=salt)
            list(stream)
            return stream.started.cached_tokens

        assert cached("a") == 0 and cached("b") == 0 and cached("a") >= 32
        with pytest.raises(ClientError) as info:
            client.complete("x", cache_salt="")
        assert info.value.field == "cache_salt"
        with pytest.raises(ClientError) as info:  # a first-come-first-served server takes no priorities
            client.complete("x", priority=3)
        assert info.value.field == "priority"
        with pytest.raises(ClientError) as info:  # a server without a reasoning parser counts no thought
            client.complete("x", thinking_token_budget=4)
        assert info.value.field == "sampling.thinking_token_budget"
