"""vLLM's command-line flags: `--generation-config FOLDER` gives requests the model's sampling defaults where they
leave them out, `--max-logprobs` bounds what a request may ask, and the start refuses clearly (exit 2, naming the
flag) an unknown tool-call parser, auto tool choice without a parser, a model named twice, a checkpoint that needs
its own code (even with --trust-remote-code), a missing generation config and a max-logprobs past the engine's.
A `vllm serve` launch line's flags that mean what this server does anyway (one device, chunked prefill, unused swap
space, the model's own load format, vLLM's --kv-cache-memory-bytes) start it unchanged; the values that ask for
what it does not do stop the start naming the flag."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys

import openai
import pytest
import requests
from service_fixtures import start_server
from test_openai_http_errors import CHAT, COMPLETIONS, post

from pagedserve.service.cli import main

MODEL = "SmolLM2-135M-Instruct"
# As Helm charts and launch scripts for vLLM pass them, half in a --config file (a ConfigMap's way), half on the
# command line (underscores too); --gpu-memory-utilization does nothing on CPU, and the command line's
# --kv-cache-memory 32MiB (service_fixtures.BASE_ARGS) wins over the file's --kv-cache-memory-bytes 48MiB.
VLLM_CONFIG_FILE = """\
tensor-parallel-size: 1
enable-chunked-prefill: true
swap_space: 16
load-format: gguf
gpu-memory-utilization: 0.9
kv-cache-memory-bytes: 48MiB
served-model-name: [SmolLM2-135M-Instruct, gpt-4o-mini]  # the reported name, then an alias requests may use
"""
# The model's generation config says temperature 1.0; vLLM's override makes the defaults greedy.
VLLM_LAUNCH_LINE = ("-pp", "1", "--data_parallel_size", "1", "--enable-prompt-tokens-details",
                    "--enable-force-include-usage", "--override-generation-config", '{"temperature": 0.0}',
                    "--response-role", "narrator", "--default-chat-template-kwargs", '{"enable_thinking": false}',
                    "--enable-request-id-headers")


@pytest.fixture(scope="module")
def defaults_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generation-config")
    (folder / "vllm.yaml").write_text(VLLM_CONFIG_FILE)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 1.0, "max_new_tokens": 5,
                                                                "bos_token_id": 1}))
    server = start_server(folder / "server", "--http-port", "0", "--generation-config", str(folder),
                          "--max-logprobs", "2", "--config", str(folder / "vllm.yaml"), *VLLM_LAUNCH_LINE)
    yield server
    server.stop()


def test_generation_config_defaults_apply_where_the_request_is_silent(defaults_server):
    messages = [{"role": "user", "content": "Tell me a long story about the sea."}]
    silent = [post(defaults_server.http_port, CHAT, {"messages": messages})[1] for _ in range(2)]
    assert all(r["usage"]["completion_tokens"] == 5 for r in silent), silent  # max_new_tokens
    assert silent[0]["choices"][0]["message"] == silent[1]["choices"][0]["message"]  # the override's greedy
    assert silent[0]["choices"][0]["message"]["role"] == "narrator"  # --response-role: a new turn
    explicit = post(defaults_server.http_port, CHAT, {"messages": messages, "temperature": 0, "max_tokens": 5})[1]
    assert explicit["choices"][0]["message"] == silent[0]["choices"][0]["message"]
    longer = post(defaults_server.http_port, CHAT, {"messages": messages, "max_tokens": 9, "ignore_eos": True})[1]
    assert longer["usage"]["completion_tokens"] == 9  # the request's own value wins
    assert "sampling defaults with --override-generation-config: {'temperature': 0.0, 'max_tokens': 5}" \
        in defaults_server.log()
    continued = post(defaults_server.http_port, CHAT, {"messages": [*messages, {"role": "assistant", "content": "Once"}],
                                                       "add_generation_prompt": False, "continue_final_message": True,
                                                       "max_tokens": 2})[1]
    assert continued["choices"][0]["message"]["role"] == "assistant"  # a continued turn keeps its own role


def test_max_logprobs_bounds_requests(defaults_server):
    status, reply = post(defaults_server.http_port, COMPLETIONS, {"prompt": "Hi", "logprobs": 3})
    assert status == 400 and reply["error"]["param"] == "logprobs" and "--max-logprobs" in reply["error"]["message"]
    status, reply = post(defaults_server.http_port, CHAT, {"messages": [{"role": "user", "content": "Hi"}],
                                                           "logprobs": True, "top_logprobs": 3})
    assert status == 400 and reply["error"]["param"] == "top_logprobs"
    status, reply = post(defaults_server.http_port, COMPLETIONS, {"prompt": "Hi", "logprobs": 2, "max_tokens": 2})
    assert status == 200 and len(reply["choices"][0]["logprobs"]["top_logprobs"][0]) >= 2


def test_a_vllm_launch_line_starts_the_server(defaults_server):
    log = defaults_server.log()
    assert "--swap-space 16.0 accepted and unused" in log
    assert "--kv-cache-memory 33554432 given: --gpu-memory-utilization 0.9 is not used" in log
    cache = re.search(r"KV cache: \d+ blocks .*, ([\d.]+) MiB", log)
    assert cache and 30 < float(cache.group(1)) <= 32, log[-3000:]  # whole blocks within the command line's 32MiB
    status, reply = post(defaults_server.http_port, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_force_include_usage_puts_usage_on_every_stream_chunk(defaults_server):
    with openai.OpenAI(base_url=f"{defaults_server.http_url}/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        for options in (None, {"include_usage": False}):  # vLLM's rule: the flag wins over the request's false
            chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True,
                                                    stream_options=options, extra_body={"ignore_eos": True}))
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3, chunks[-1]
            # and, as vLLM's flag does, the running usage on every chunk before it
            assert [c.usage.completion_tokens for c in chunks[:-1]][-1] == 3 and all(c.usage for c in chunks)
        whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2)
        assert whole.usage.completion_tokens == 2  # a whole response carries it anyway


def test_every_served_model_name_is_the_model(defaults_server):
    status, reply = post(defaults_server.http_port, CHAT, {"model": "gpt-4o-mini", "max_tokens": 2,
                                                           "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and reply["model"] == MODEL  # answers carry the first name, as vLLM's
    status, reply = post(defaults_server.http_port, COMPLETIONS, {"model": "gpt-4o", "prompt": "Hi"})
    assert status == 404 and reply["error"]["param"] == "model"
    listed = requests.get(f"{defaults_server.http_url}/v1/models", timeout=60).json()["data"]
    assert [card["id"] for card in listed] == [MODEL, "gpt-4o-mini"] and {c["root"] for c in listed} == {MODEL}
    card = requests.get(f"{defaults_server.http_url}/v1/models/gpt-4o-mini", timeout=60).json()
    assert card["id"] == "gpt-4o-mini"
    status, reply = post(defaults_server.http_port, "/tokenize", {"model": "gpt-4o-mini", "prompt": "Hi"})
    assert status == 200 and reply["count"] >= 1


REFUSED_STARTS = [  # (id, flags, message); REMOTE stands for a checkpoint folder whose config.json has auto_map
    ("unknown-parser", ("--tool-call-parser", "no_such"), "unknown tool-call parser 'no_such'; supported: hermes"),
    ("auto-without-parser", ("--enable-auto-tool-choice",), "needs --tool-call-parser"),
    ("model-twice", (MODEL, "--model", "other"), "given twice"),
    ("remote-code", ("REMOTE", "--trust-remote-code"), "needs the checkpoint's own code (config.json auto_map"),
    ("no-generation-config", ("--generation-config", "missing"), "generation_config.json does not exist"),
    ("max-logprobs", ("--max-logprobs", "21"), "max_logprobs: must be in [0, 20]"),
    ("padded-api-key", ("--api-key", " padded "), "api_key: must be a non-empty string"),
]


@pytest.mark.parametrize(("args", "message"), [c[1:] for c in REFUSED_STARTS], ids=[c[0] for c in REFUSED_STARTS])
def test_bad_flags_stop_the_start_naming_them(tmp_path, args, message):
    remote = tmp_path / "remote-code-model"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}))
    args = [str(remote) if a == "REMOTE" else a for a in args]
    # A refusal comes before the model loads; the timeout only bounds imports on a busy machine.
    proc = subprocess.run([sys.executable, "-m", "pagedserve.service", "serve", "--port", "0", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


VLLM_REFUSALS = [  # (id, flags, message): refused before anything loads, so run in this process
    ("tensor-parallel", ("--tensor-parallel-size", "2"), "argument --tensor-parallel-size/-tp: 2: one device per"),
    ("pipeline-parallel", ("-pp", "4"), "argument --pipeline-parallel-size/-pp: 4: one device per server"),
    ("data-parallel", ("-dp", "2"), "argument --data-parallel-size/-dp: 2: one device per server"),
    ("no-chunked-prefill", ("--no-enable-chunked-prefill",), "--no-enable-chunked-prefill: prefills are always"),
    ("load-format", ("--load-format", "safetensors"), "--load-format safetensors, but"),
    ("load-format-choice", ("--load-format", "pt"), "argument --load-format: invalid choice: 'pt'"),
    ("swap-space", ("--swap-space", "-1"), "argument --swap-space: must be >= 0 GiB"),
    ("gpu-memory-utilization", ("--gpu-memory-utilization", "0"), "gpu_memory_utilization: must be in (0, 1]"),
]


@pytest.mark.parametrize(("args", "message"), [c[1:] for c in VLLM_REFUSALS], ids=[c[0] for c in VLLM_REFUSALS])
def test_vllm_flags_that_ask_for_more_stop_the_start(args, message):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            code = main(["serve", "--port", "0", *args])
        except SystemExit as exited:  # argparse's refusals
            code = exited.code
    assert code == 2 and message in stderr.getvalue(), stderr.getvalue()


def test_request_id_headers_on_every_reply(defaults_server):
    """--enable-request-id-headers: a client's x-request-id is echoed, and a reply to a client without one still
    carries one (made per request), on generation routes and the others alike."""
    url = defaults_server.http_url
    made = [requests.get(f"{url}/v1/models", timeout=30).headers["x-request-id"] for _ in range(2)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", m) for m in made) and made[0] != made[1]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    generated = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert generated.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", generated.headers["x-request-id"])
    echoed = requests.post(f"{url}/v1/chat/completions", json=body, headers={"x-request-id": "mine-1"}, timeout=120)
    assert echoed.headers["x-request-id"] == "mine-1"
    refused = requests.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=60)
    assert refused.status_code == 400 and refused.headers["x-request-id"]
