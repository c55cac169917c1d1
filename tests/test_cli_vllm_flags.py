"""vLLM's command-line flags: `--generation-config FOLDER` gives requests the model's sampling defaults where they
leave them out, `--max-logprobs` bounds what a request may ask, and the start refuses clearly (exit 2, naming the
flag) an unknown tool-call parser, auto tool choice without a parser, a model named twice, a checkpoint that needs
its own code (even with --trust-remote-code), a missing generation config and a max-logprobs past the engine's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from service_fixtures import start_server
from test_openai_http_errors import CHAT, COMPLETIONS, post

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def defaults_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generation-config")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5,
                                                                "bos_token_id": 1}))
    server = start_server(folder / "server", "--http-port", "0", "--generation-config", str(folder),
                          "--max-logprobs", "2")
    yield server
    server.stop()


def test_generation_config_defaults_apply_where_the_request_is_silent(defaults_server):
    messages = [{"role": "user", "content": "Tell me a long story about the sea."}]
    silent = [post(defaults_server.http_port, CHAT, {"messages": messages})[1] for _ in range(2)]
    assert all(r["usage"]["completion_tokens"] == 5 for r in silent), silent  # max_new_tokens
    assert silent[0]["choices"][0]["message"] == silent[1]["choices"][0]["message"]  # temperature 0: greedy
    explicit = post(defaults_server.http_port, CHAT, {"messages": messages, "temperature": 0, "max_tokens": 5})[1]
    assert explicit["choices"][0]["message"] == silent[0]["choices"][0]["message"]
    longer = post(defaults_server.http_port, CHAT, {"messages": messages, "max_tokens": 9, "ignore_eos": True})[1]
    assert longer["usage"]["completion_tokens"] == 9  # the request's own value wins
    assert "sampling defaults from" in defaults_server.log()


def test_max_logprobs_bounds_requests(defaults_server):
    status, reply = post(defaults_server.http_port, COMPLETIONS, {"prompt": "Hi", "logprobs": 3})
    assert status == 400 and reply["error"]["param"] == "logprobs" and "--max-logprobs" in reply["error"]["message"]
    status, reply = post(defaults_server.http_port, CHAT, {"messages": [{"role": "user", "content": "Hi"}],
                                                           "logprobs": True, "top_logprobs": 3})
    assert status == 400 and reply["error"]["param"] == "top_logprobs"
    status, reply = post(defaults_server.http_port, COMPLETIONS, {"prompt": "Hi", "logprobs": 2, "max_tokens": 2})
    assert status == 200 and len(reply["choices"][0]["logprobs"]["top_logprobs"][0]) >= 2


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
