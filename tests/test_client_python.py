"""The typed Python client (sync and asyncio) and its CLI, against a real server process."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import grpc
import pytest
from service_fixtures import engine_idle, shared_server, wait_until  # noqa: F401 - fixtures are used by name

from pagedserve.client import AsyncClient, Client, ClientError, FinishReason, GenerateOptions, build_request

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(shared_server) -> Client:  # noqa: F811
    with Client(shared_server.target, timeout=300) as c:
        yield c


def test_generate_yields_deltas_and_records_started_and_final(client):
    stream = client.generate(PROMPT, temperature=0, max_new_tokens=8, ignore_eos=True, request_id="client-1")
    deltas = list(stream)
    assert len(deltas) > 1 and all(d.index == 0 for d in deltas)
    assert stream.request_id == "client-1" and stream.started.request_id == "client-1"
    final = stream.finals[0]
    assert final.finish_reason is FinishReason.MAX_TOKENS
    assert final.usage.completion_tokens == sum(len(d.token_ids) for d in deltas) == 8
    [completion] = stream.results()
    assert completion.text == "".join(d.text for d in deltas)


def test_complete_matches_the_concatenated_stream(client):
    completion = client.complete(PROMPT, temperature=0, max_new_tokens=8, ignore_eos=True)
    streamed = client.generate(PROMPT, temperature=0, max_new_tokens=8, ignore_eos=True)
    assert completion.text == "".join(d.text for d in streamed)
    assert completion.finish_reason is FinishReason.MAX_TOKENS and len(completion.token_ids) == 8


def test_token_id_prompt_and_tokenize_round_trip(client):
    ids = client.tokenize(PROMPT).token_ids
    by_ids = client.complete(list(ids), temperature=0, max_new_tokens=4, ignore_eos=True)
    by_text = client.complete(PROMPT, temperature=0, max_new_tokens=4, ignore_eos=True)
    assert by_ids.token_ids == by_text.token_ids


def test_invalid_argument_is_a_typed_error_with_the_field(client):
    with pytest.raises(ClientError) as info:
        client.complete(PROMPT, top_p=0.0)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.field == "sampling.top_p"


def test_prompt_logprobs_come_with_started(client, shared_server):  # noqa: F811
    import requests

    ids = list(client.tokenize(PROMPT).token_ids)
    stream = client.generate(ids, temperature=0, max_new_tokens=2, prompt_logprobs=2, final_only=True)
    list(stream)
    scores = stream.started.prompt_logprobs
    assert [lp.token_id for lp in scores] == ids[1:]  # the first prompt token has no score
    assert all(lp.rank >= 1 and len(lp.top) == 2 and lp.logprob <= 0 for lp in scores)
    # the same engine's scores through the OpenAI surface (float32 on the wire here: within its rounding)
    reply = requests.post(f"{shared_server.http_url}/v1/completions", timeout=120, json={
        "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}).json()
    http = reply["choices"][0]["prompt_logprobs"][1:]
    for lp, entry in zip(scores, http):
        assert abs(entry[str(lp.token_id)]["logprob"] - lp.logprob) < 2e-3 and entry[str(lp.token_id)]["rank"] == lp.rank
    plain = client.generate(ids, temperature=0, max_new_tokens=2)
    list(plain)
    assert plain.started.prompt_logprobs == ()
    with pytest.raises(ClientError) as info:
        client.complete(PROMPT, prompt_logprobs=21)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT and info.value.field == "response.prompt_logprobs"


def test_unknown_option_is_rejected_locally():
    with pytest.raises(TypeError, match="temprature"):
        GenerateOptions.from_kwargs(temprature=0.5)


def test_options_left_unset_stay_unset_in_the_request():
    request = build_request("hi", GenerateOptions(temperature=0.0, max_new_tokens=3))
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert not request.sampling.HasField("top_p") and not request.stopping.HasField("min_new_tokens")


def test_cancel_stops_the_stream_and_frees_the_request(client, shared_server):  # noqa: F811
    stream = client.generate("Write a long essay about oceans.", max_new_tokens=400, ignore_eos=True)
    next(stream)
    stream.cancel()
    with pytest.raises(ClientError) as info:
        list(stream)
    assert info.value.code is grpc.StatusCode.CANCELLED
    with grpc.insecure_channel(shared_server.target) as channel:
        wait_until(lambda: engine_idle(channel), 60, "the cancelled request to leave the engine")


def test_deadline_raises_deadline_exceeded(client):
    with pytest.raises(ClientError) as info:
        client.complete("Count to a thousand:", max_new_tokens=400, ignore_eos=True, timeout=1.0)
    assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED


def test_async_client_streams_concurrently(shared_server):  # noqa: F811
    async def main() -> tuple[list, list[str]]:
        async with AsyncClient(shared_server.target, timeout=300) as client:
            completions = await asyncio.gather(*(
                client.complete(p, temperature=0, max_new_tokens=6, ignore_eos=True) for p in (PROMPT, "Hi there")))
            stream = client.generate(PROMPT, temperature=0, max_new_tokens=6, ignore_eos=True)
            texts = [d.text async for d in stream]
            info = await client.model_info()
            assert info.vocab_size > 0
            return completions, texts

    completions, texts = asyncio.run(main())
    assert [c.finish_reason for c in completions] == [FinishReason.MAX_TOKENS] * 2
    assert completions[0].text == "".join(texts)


def test_async_cancel_and_errors(shared_server):  # noqa: F811
    async def main() -> tuple[grpc.StatusCode, grpc.StatusCode]:
        async with AsyncClient(shared_server.target, timeout=300) as client:
            stream = client.generate("Tell me a long story.", max_new_tokens=400, ignore_eos=True)
            await stream.__anext__()
            stream.cancel()
            try:
                await stream.results()
            except ClientError as exc:
                cancelled = exc.code
            try:
                await client.complete("", max_new_tokens=2)
            except ClientError as exc:
                invalid = exc.code
            return cancelled, invalid

    assert asyncio.run(main()) == (grpc.StatusCode.CANCELLED, grpc.StatusCode.INVALID_ARGUMENT)


def test_cli_streams_the_completion_to_stdout(shared_server, client, tmp_path):  # noqa: F811
    expected = client.complete(PROMPT, temperature=0, max_new_tokens=8, ignore_eos=True).text
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve.client.cli", "--target", shared_server.target, "generate", PROMPT,
         "--temperature", "0", "--max-new-tokens", "8", "--ignore-eos"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"
    assert "max_tokens" in result.stderr


def test_cli_reports_errors_with_exit_status_1(shared_server, tmp_path):  # noqa: F811
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve.client.cli", "--target", shared_server.target, "generate", "x",
         "--top-p", "0"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr and "sampling.top_p" in result.stderr


def test_cli_constraint_flags(shared_server, tmp_path):  # noqa: F811
    """--choice / --regex / --json-schema @FILE constrain the printed answer; two of them are refused by argparse."""
    def cli(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pagedserve.client.cli", "--target", shared_server.target,
                               "generate", "Is Paris in France? Answer:", "--temperature", "0", "--max-new-tokens",
                               "40", *flags], cwd=tmp_path, capture_output=True, text=True, timeout=300)

    assert cli("--choice", "yes", "--choice", "no").stdout.strip() in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}", cli("--regex", "[0-9]{3}").stdout.strip())
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    assert isinstance(json.loads(cli("--json-schema", "@schema.json").stdout)["ok"], bool)
    both = cli("--regex", "a", "--json-object")
    assert both.returncode == 2 and "not allowed with" in both.stderr
    bad = cli("--regex", "(")
    assert bad.returncode == 1 and "constraint.regex" in bad.stderr
