"""Bad HTTP input gets OpenAI's error JSON with the right status and parameter, and harms nothing; a client that
disconnects aborts its request; a full queue is 429 and a draining server 503."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time

import grpc
import openai
import pytest
from chat_templates import QWEN2
from transformers import AutoTokenizer
from service_fixtures import (  # noqa: F401 - fixtures by name
    ServerProcess,
    engine_idle,
    metric_value,
    model_info,
    shared_server,
    start_server,
    wait_until,
)

from pagedserve.client import Client

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]
LONG = dict(temperature=0, max_tokens=400, ignore_eos=True)


def post(port: int, path: str, body: bytes | dict, timeout: float = 120) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, data, {"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


BAD_INPUTS = [  # (id, path, body, status, param)
    ("malformed-json", COMPLETIONS, b'{"prompt": "x",', 400, None),
    ("empty-body", CHAT, b"", 400, None),
    ("not-an-object", COMPLETIONS, b"[1, 2]", 400, "body"),
    ("temperature-string", COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("max-tokens-string", COMPLETIONS, {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("n-float", COMPLETIONS, {"prompt": "x", "n": 1.5}, 400, "n"),
    ("stream-string", CHAT, {"messages": USER, "stream": "yes"}, 400, "stream"),
    ("prompt-number", COMPLETIONS, {"prompt": 5}, 400, "prompt"),
    ("messages-string", CHAT, {"messages": "hi"}, 400, "messages"),
    ("logit-bias-keys", COMPLETIONS, {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("temperature-negative", COMPLETIONS, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("n-zero", CHAT, {"messages": USER, "n": 0}, 400, "n"),
    ("n-greedy", CHAT, {"messages": USER, "n": 2, "temperature": 0}, 400, "n"),
    ("top-p-zero", COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("presence-penalty", CHAT, {"messages": USER, "presence_penalty": 3}, 400, "presence_penalty"),
    ("seed-negative", COMPLETIONS, {"prompt": "x", "seed": -1}, 400, "seed"),
    ("max-tokens-over-context", COMPLETIONS, {"prompt": "x", "max_tokens": 100_000}, 400, "max_tokens"),
    ("max-completion-tokens-over-context", CHAT, {"messages": USER, "max_completion_tokens": 100_000}, 400,
     "max_completion_tokens"),
    ("prompt-over-context", COMPLETIONS, {"prompt": "word " * 600}, 400, "prompt"),
    ("batch-prompt-over-context", COMPLETIONS, {"prompt": ["x", "word " * 600]}, 400, "prompt[1]"),
    ("batch-of-mixed-types", COMPLETIONS, {"prompt": ["x", 5]}, 400, "prompt"),
    ("token-id-outside-vocab", COMPLETIONS, {"prompt": [1, 2, 99_999_999]}, 400, "prompt[2]"),
    ("unknown-role", CHAT, {"messages": [*USER, {"role": "wizard", "content": "x"}]}, 400, "messages[1].role"),
    ("empty-messages", CHAT, {"messages": []}, 400, "messages"),
    ("image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0]"),
    ("template-syntax", CHAT, {"messages": USER, "chat_template": "{% if %}"}, 400, "chat_template"),
    ("logprobs-string", CHAT, {"messages": USER, "logprobs": "yes", "top_logprobs": 2}, 400, "logprobs"),
    ("top-logprobs-without-logprobs", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top-logprobs-too-many", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("tool-choice-auto-without-the-flag", CHAT, {"messages": USER, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, 400, "tool_choice"),
    ("priority-without-a-priority-scheduler", CHAT, {"messages": USER, "priority": 5}, 400, "priority"),
    ("prompt-logprobs-negative", COMPLETIONS, {"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("prompt-logprobs-too-many", CHAT, {"messages": USER, "prompt_logprobs": 50}, 400, "prompt_logprobs"),
    ("prompt-logprobs-string", COMPLETIONS, {"prompt": "x", "prompt_logprobs": "2"}, 400, "prompt_logprobs"),
    ("prompt-logprobs-streamed", COMPLETIONS, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs"),
    ("best-of-above-n", COMPLETIONS, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("truncate-prompt-tokens-zero", COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens"),
    ("allowed-token-ids-empty", COMPLETIONS, {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("allowed-token-id-outside-vocab", COMPLETIONS, {"prompt": "x", "allowed_token_ids": [99_999_999]}, 400,
     "allowed_token_ids"),
    ("bad-words-not-strings", CHAT, {"messages": USER, "bad_words": [1]}, 400, "bad_words"),
    ("chat-template-kwargs-list", CHAT, {"messages": USER, "chat_template_kwargs": [1]}, 400, "chat_template_kwargs"),
    ("continue-final-with-generation-prompt", CHAT, {"messages": USER, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("stream-options-without-stream", CHAT, {"messages": USER, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("too-many-stops", COMPLETIONS, {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("ten-megabyte-body", COMPLETIONS, {"prompt": "x" * (10 << 20)}, 413, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_the_status_and_names_the_parameter(shared_server, path, body, status, param):  # noqa: F811
    got_status, reply = post(shared_server.http_port, path, body)
    assert got_status == status, reply
    error = reply["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["message"].startswith(param)
    if status == 413:
        assert "--max-message-bytes" in error["message"]


def test_both_protocols_keep_serving_after_bad_input(shared_server):  # noqa: F811
    for _, path, body, _, _ in BAD_INPUTS[:4]:
        post(shared_server.http_port, path, body)
    status, reply = post(shared_server.http_port, COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 4,
                                                                "temperature": 0})
    assert status == 200 and reply["choices"][0]["text"]
    with Client(shared_server.target, timeout=120) as client:
        assert client.complete("The capital of France is", temperature=0, max_new_tokens=4).text == \
            reply["choices"][0]["text"]
    with grpc.insecure_channel(shared_server.target) as channel:
        wait_until(lambda: engine_idle(channel), 30, "no request or KV block left behind")


def _open_stream(port: int, body: dict) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", COMPLETIONS, json.dumps({**body, "stream": True}).encode(),
                 {"content-type": "application/json"})
    return conn


def _read_events(response: http.client.HTTPResponse, count: int) -> list[dict]:
    events = []
    while len(events) < count:
        line = response.readline()
        assert line, "the stream ended early"
        if line.startswith(b"data: {"):
            events.append(json.loads(line[len(b"data: "):]))
    return events


def test_sse_disconnect_aborts_the_request_and_frees_its_blocks(shared_server):  # noqa: F811
    aborted = metric_value(shared_server, "pagedserve:requests_aborted_total")
    with grpc.insecure_channel(shared_server.target) as channel:
        wait_until(lambda: engine_idle(channel), 30, "an idle engine before the test")
        conn = _open_stream(shared_server.http_port, {"prompt": "Once upon a time", **LONG})
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
        _read_events(response, 3)
        assert model_info(channel).scheduler.running_requests == 1
        conn.sock.shutdown(2)  # the client goes away mid-generation
        conn.close()
        start = time.monotonic()
        wait_until(lambda: engine_idle(channel), 30, "the disconnected stream's request and KV blocks to be freed")
        elapsed = time.monotonic() - start
    assert metric_value(shared_server, "pagedserve:requests_aborted_total") == aborted + 1, \
        f"aborted by the disconnect (freed after {elapsed:.2f}s), not run to its 400 tokens"


def test_disconnect_from_a_two_prompt_batch_aborts_both_requests(shared_server):  # noqa: F811
    """A batch's streams are merged by tasks of their own (one stream is read directly): the disconnect cancels
    those too."""
    aborted = metric_value(shared_server, "pagedserve:requests_aborted_total")
    with grpc.insecure_channel(shared_server.target) as channel:
        wait_until(lambda: engine_idle(channel), 30, "an idle engine before the test")
        conn = _open_stream(shared_server.http_port, {"prompt": ["Once upon a time", "In a small village"], **LONG})
        _read_events(conn.getresponse(), 4)
        assert model_info(channel).scheduler.running_requests == 2
        conn.sock.shutdown(2)
        conn.close()
        wait_until(lambda: engine_idle(channel), 30, "both of the batch's requests and their KV blocks to be freed")
    assert metric_value(shared_server, "pagedserve:requests_aborted_total") == aborted + 2


def test_non_streaming_client_timeout_aborts_the_request(shared_server):  # noqa: F811
    aborted = metric_value(shared_server, "pagedserve:requests_aborted_total")
    with openai.OpenAI(base_url=f"{shared_server.http_url}/v1", api_key="unused", max_retries=0, timeout=1.0) as oai:
        with pytest.raises(openai.APITimeoutError):
            oai.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=400,
                                   temperature=0, extra_body={"ignore_eos": True})
    with grpc.insecure_channel(shared_server.target) as channel:
        wait_until(lambda: engine_idle(channel), 30, "the abandoned request to be freed")
    assert metric_value(shared_server, "pagedserve:requests_aborted_total") == aborted + 1


@pytest.fixture(scope="module")
def small_queue_server(tmp_path_factory) -> ServerProcess:
    """One running and one waiting request at most; the chat template comes from --chat-template."""
    template = tmp_path_factory.mktemp("template") / "qwen2.jinja"
    template.write_text(QWEN2)
    server = start_server(tmp_path_factory.mktemp("queue-server"), "--http-port", "0", "--max-num-seqs", "1",
                          "--max-queued-requests", "1", "--chat-template", str(template))
    yield server
    server.stop()


def test_chat_template_flag_replaces_the_models(small_queue_server, default_model):
    tokenizer = AutoTokenizer.from_pretrained(str(default_model.tokenizer_dir))
    expected = tokenizer.apply_chat_template(USER, chat_template=QWEN2, add_generation_prompt=True, return_dict=False)
    status, reply = post(small_queue_server.http_port, CHAT, {"messages": USER, "max_tokens": 2})
    assert status == 200 and reply["usage"]["prompt_tokens"] == len(expected), reply


def test_full_queue_is_429_and_draining_is_503(small_queue_server):
    server = small_queue_server
    running = _open_stream(server.http_port, {"prompt": "Once upon a time", **LONG})
    _read_events(running.getresponse(), 1)
    waiting = _open_stream(server.http_port, {"prompt": "In a small village", **LONG})  # headers come with output
    with grpc.insecure_channel(server.target) as channel:
        wait_until(lambda: model_info(channel).scheduler.waiting_requests == 1, 60, "a request in the queue")
    status, reply = post(server.http_port, COMPLETIONS, {"prompt": "x", "max_tokens": 2})
    assert status == 429 and reply["error"]["type"] == "rate_limit_exceeded", reply
    server.signal(signal.SIGTERM)
    wait_until(lambda: _health(server.http_port) == 503, 60, "/health to report draining")
    status, reply = post(server.http_port, CHAT, {"messages": USER, "max_tokens": 2})
    assert status == 503 and reply["error"]["type"] == "service_unavailable", reply
    running.close()
    waiting.close()
    assert server.wait(120) == 0


def _health(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def test_a_taken_http_port_stops_the_start_with_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "pagedserve.service", "serve", "--port", "0", "--http-port",
                               str(port)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"http_port: cannot listen on 127.0.0.1:{port}" in done.stderr
