"""LoRA adapters on every front end, against one real server on a tiny random Llama with adapters written by peft:
OpenAI `model` and pagedserve.v1 `adapter` pick the adapter (each answer equals transformers + peft's greedy tokens,
in batches mixing adapters and the base), /v1/models lists them with their parent, runtime load/unload (HTTP and
AdapterService) with vLLM's answers, bad adapters refused by field while the server keeps serving, an unload with a
request in flight refused and the request unaffected, and the Gateway API Inference Extension's
`vllm:lora_requests_info` gauge; the Go and Java clients through tests/test_clients_go_java.py's conformance
drivers, and README's LoRA snippet."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from lora_surface_fixtures import LoraSet, copy_adapter, make_adapter, make_lora_set, peft_greedy, post
from service_fixtures import ServerProcess, start_server, wait_until
from test_clients_go_java import LANGS, Driver, _missing, built_clients, request_json  # noqa: F401 - a fixture

from pagedserve.client import AsyncClient, Client, ClientError

NAMES = ("sql", "chat", "code", "math", "late")  # "late" is loaded at runtime
STARTUP = NAMES[:4]
KEPT = STARTUP[:2]  # never unloaded (the in-flight test unloads "code")
SERVED = "tiny-base"
PROMPT = [1, 504, 3492, 314, 4649, 28, 253, 1345]
TOKENS = 8


@pytest.fixture(scope="module")
def lora_set(tmp_path_factory) -> LoraSet:
    return make_lora_set(tmp_path_factory.mktemp("lora"), NAMES)


@pytest.fixture(scope="module")
def expected(lora_set) -> dict[str | None, list[int]]:
    """transformers + peft greedy tokens per adapter (None: the base); every adapter changes the output."""
    tokens = {name: peft_greedy(lora_set, name, PROMPT, TOKENS) for name in (None, *NAMES)}
    assert len({tuple(t) for t in tokens.values()}) == len(tokens), f"adapters must change the output: {tokens}"
    return tokens


@pytest.fixture(scope="module")
def server(lora_set, tmp_path_factory) -> Iterator[ServerProcess]:
    modules = [f"{name}={lora_set.adapters[name]}" for name in (*STARTUP[:2], STARTUP[3])]
    modules.append(json.dumps({"name": STARTUP[2], "path": str(lora_set.adapters[STARTUP[2]]),
                               "base_model_name": SERVED}))
    proc = start_server(tmp_path_factory.mktemp("lora-server"), "--model", str(lora_set.base), "--http-port", "0",
                        "--served-model-name", SERVED, "--enable-lora", "--lora-modules", *modules,
                        "--max-loras", "2", "--max-cpu-loras", "8", "--max-lora-rank", "16",
                        "--enable-runtime-lora-updates", "--allowed-lora-dirs", str(lora_set.root))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> Iterator[Client]:
    with Client(server.target, timeout=120) as c:
        yield c


def get(server: ServerProcess, path: str) -> object:
    with urllib.request.urlopen(server.http_url + path, timeout=30) as reply:
        return json.loads(reply.read())


def http_tokens(server: ServerProcess, model: str | None, max_tokens: int = TOKENS) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **({"model": model} if model is not None else {})}
    status, reply = post(server, "/v1/completions", body)
    assert status == 200, reply
    assert reply["model"] == (model or SERVED)
    return reply["choices"][0]["token_ids"]


def grpc_tokens(client: Client, adapter: str | None, max_tokens: int = TOKENS) -> list[int]:
    return client.complete(PROMPT, adapter=adapter, temperature=0.0, max_new_tokens=max_tokens,
                           ignore_eos=True).token_ids


def test_mixed_batch_of_adapters_and_base_on_both_front_ends(server, client, expected):
    """Base and four adapters at once on HTTP and gRPC (more distinct adapters than --max-loras 2): each answer is
    its own adapter's, token for token."""
    models = [None, *STARTUP]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        http = {m: pool.submit(http_tokens, server, m) for m in models}
        rpc = {m: pool.submit(grpc_tokens, client, m) for m in models}
        for model in models:
            assert http[model].result() == expected[model], f"HTTP model={model}"
            assert rpc[model].result() == expected[model], f"gRPC adapter={model}"
    assert http_tokens(server, SERVED) == expected[None]  # the base's own name


def test_models_lists_adapters_with_parent_and_root(server, lora_set, client):
    cards = {card["id"]: card for card in get(server, "/v1/models")["data"]}
    assert cards[SERVED]["parent"] is None
    for name in STARTUP:
        assert cards[name]["parent"] == SERVED
        assert os.path.realpath(cards[name]["root"]) == os.path.realpath(lora_set.adapters[name])
    assert get(server, f"/v1/models/{STARTUP[0]}")["parent"] == SERVED
    listed = client.list_adapters()
    assert set(STARTUP) <= set(listed.names()) and listed.runtime_updates and listed.max_loras == 2
    assert listed.base_model == SERVED and all(a.rank == 8 and a.adapter_id > 0 for a in listed.adapters)
    assert set(STARTUP) <= {a.name for a in client.model_info().adapters}

    async def async_names() -> tuple[str, ...]:
        async with AsyncClient(server.target, timeout=60) as c:
            return (await c.list_adapters()).names()

    assert asyncio.run(async_names()) == listed.names()


def test_unknown_adapter_is_not_found_naming_the_field(server, client):
    status, reply = post(server, "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert status == 404 and reply["error"]["param"] == "model" and "nope" in reply["error"]["message"]
    status, reply = post(server, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user",
                                                                                        "content": "hi"}]})
    assert status == 404 and reply["error"]["param"] == "model"
    with pytest.raises(ClientError) as error:
        client.complete("hi", adapter="nope", max_new_tokens=2)
    assert error.value.code == grpc.StatusCode.NOT_FOUND and error.value.field == "adapter"


def test_tokenize_takes_an_adapter_name_as_vllm_does(server):
    """/tokenize and /detokenize accept a LoRA adapter's name as `model` (the adapter shares the base's tokenizer) and
    refuse what the completions endpoints refuse, with the same status and field."""
    text = "Tokens of an adapter request"
    base = post(server, "/tokenize", {"model": SERVED, "prompt": text})
    adapter = post(server, "/tokenize", {"model": KEPT[0], "prompt": text})
    assert base[0] == adapter[0] == 200 and adapter[1]["tokens"] == base[1]["tokens"]
    assert post(server, "/detokenize", {"model": KEPT[1], "tokens": base[1]["tokens"]}) == (200, {"prompt": text})
    for path in ("/tokenize", "/detokenize"):
        status, reply = post(server, path, {"model": "nope", "prompt": text, "tokens": [1]})
        assert status == 404 and reply["error"]["param"] == "model" and "nope" in reply["error"]["message"]
        status, reply = post(server, path, {"model": 7, "prompt": text, "tokens": [1]})
        assert status == 400 and reply["error"]["param"] == "model"


def test_runtime_load_serves_as_a_startup_adapter(server, client, lora_set, expected):
    status, reply = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path":
                                                           str(lora_set.adapters["late"])})
    assert status == 200 and reply == "Success: LoRA adapter 'late' added successfully.", reply
    copy = copy_adapter(lora_set.adapters["sql"], lora_set.root / "sql-copy")
    loaded = client.load_adapter("sql-again", str(copy))
    assert loaded.name == "sql-again" and loaded.rank == 8
    assert http_tokens(server, "late") == expected["late"]
    assert grpc_tokens(client, "sql-again") == expected["sql"] == http_tokens(server, "sql-again")
    # The same name and path again is a no-op; the same name with another path is refused naming lora_name.
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path":
                                                  str(lora_set.adapters["late"])})[0] == 200
    status, reply = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(copy)})
    assert status == 400 and reply["error"]["param"] == "lora_name"


def _bad_adapters(lora_set: LoraSet, outside: Path) -> list[tuple[str, str, str]]:
    """(name, path, the field its error names)."""
    root = lora_set.root
    missing = copy_adapter(lora_set.adapters["sql"], root / "no-weights")
    (missing / "adapter_model.safetensors").unlink()
    pickled = copy_adapter(lora_set.adapters["sql"], root / "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    big = make_adapter(lora_set.base, root / "rank-32", seed=7, rank=32)
    copy_adapter(lora_set.adapters["sql"], outside / "elsewhere")
    (root / "link-out").symlink_to(outside / "elsewhere")
    return [("a", str(missing), "adapter_model.safetensors"), ("b", str(pickled), "adapter_model.safetensors"),
            ("c", str(big), "r"), ("d", str(outside / "elsewhere"), "lora_path"),
            ("e", str(root / "link-out"), "lora_path"), ("f", str(root / ".." / ".." / "elsewhere"), "lora_path"),
            ("g", str(root / "absent"), "lora_path"), ("bad name", str(lora_set.adapters["sql"]), "lora_name")]


def test_bad_adapters_are_refused_by_field_and_the_server_keeps_serving(server, client, lora_set, expected,
                                                                         tmp_path):
    for name, path, field in _bad_adapters(lora_set, tmp_path):
        status, reply = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert status == 400 and reply["error"]["param"] == field, (name, reply)
        with pytest.raises(ClientError) as error:
            client.load_adapter(name, path)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in str(error.value), name
    status, reply = post(server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and reply["error"]["param"] == "lora_path"
    status, reply = post(server, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert status == 404 and reply["error"]["param"] == "lora_name" and "never-loaded" in reply["error"]["message"]
    assert not {"a", "b", "c", "d", "e", "f", "g"} & set(client.list_adapters().names())
    assert http_tokens(server, "sql") == expected["sql"] and grpc_tokens(client, None) == expected[None]


def _scrape(server: ServerProcess) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).read().decode()


LORA_INFO = re.compile(r'^vllm:lora_requests_info\{([^}]*)\} (\S+)$', re.M)


def _lora_info(server: ServerProcess) -> tuple[dict[str, str], float]:
    [(labels, value)] = LORA_INFO.findall(_scrape(server))
    return dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)


def test_unload_with_a_request_in_flight_is_refused_and_the_request_unaffected(server, client, lora_set):
    """A long request on `code` runs while the unload is refused (409 / FAILED_PRECONDITION); meanwhile the gauge
    shows the adapter running; the request's tokens are the ones it gets alone; then the unload goes through."""
    alone = grpc_tokens(client, "code", max_tokens=480)
    stream = client.generate(PROMPT, adapter="code", temperature=0.0, max_new_tokens=480, ignore_eos=True)
    first = next(stream)
    status, reply = post(server, "/v1/unload_lora_adapter", {"lora_name": "code"})
    assert status == 409, reply
    with pytest.raises(ClientError) as error:
        client.unload_adapter("code")
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    labels, stamp = _lora_info(server)
    assert "code" in labels["running_lora_adapters"].split(",") and labels["max_lora"] == "2" and stamp > 1.7e9
    tokens = list(first.token_ids) + [t for delta in stream for t in delta.token_ids]
    assert tokens == alone
    wait_until(lambda: post(server, "/v1/unload_lora_adapter", {"lora_name": "code"})[0] == 200, 60, "the unload")
    assert "code" not in client.list_adapters().names()
    assert post(server, "/v1/completions", {"model": "code", "prompt": "hi", "max_tokens": 2})[0] == 404


def test_lora_metrics_as_the_gateway_reads_them(server, client):
    grpc_tokens(client, "sql")
    labels, _ = _lora_info(server)
    assert set(labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert " " not in labels["running_lora_adapters"] + labels["waiting_lora_adapters"]
    counts = dict(re.findall(r'^pagedserve:lora_requests_total\{[^}]*adapter="([^"]+)"[^}]*\} (\S+)$',
                             _scrape(server), re.M))
    assert float(counts["sql"]) >= 1


def test_readme_python_lora_snippet_and_the_cli(server, client, tmp_path):
    """README's LoRA snippet, run as written against this server: the adapters listed, then the adapter's tokens;
    `pagedserve-client generate --adapter` prints the adapter's text."""
    import subprocess
    import sys

    from test_clients_readme import SNIPPETS, at

    cli = subprocess.run([sys.executable, "-m", "pagedserve.client.cli", "--target", server.target, "generate", "hi",
                          "--adapter", "chat", "--temperature", "0", "--max-new-tokens", "8", "--ignore-eos"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    expected = client.complete("hi", adapter="chat", temperature=0, max_new_tokens=8, ignore_eos=True).text
    assert cli.stdout == expected + "\n" and expected != client.complete("hi", temperature=0, max_new_tokens=8,
                                                                         ignore_eos=True).text

    done = subprocess.run([sys.executable, "-c", at(server.target, SNIPPETS["python-lora"])], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    names, text = done.stdout.split("\n", 1)
    assert set(KEPT) <= set(names.split(","))
    assert text == client.complete("SELECT", adapter="sql", max_new_tokens=16, temperature=0).text + "\n"


@pytest.mark.skipif(bool(_missing), reason=f"Go/Java toolchains absent ({', '.join(_missing)})")
@pytest.mark.parametrize("lang", LANGS)
def test_go_and_java_clients_pick_and_manage_adapters(lang, built_clients, server, expected, tmp_path):  # noqa: F811
    driver = Driver(lang, server.target, tmp_path)
    try:
        listed = driver.call("list_adapters")
        assert listed["error"] is None and set(KEPT) <= set(listed["adapters"]) and listed["runtime_updates"]
        for adapter in (None, "sql"):
            got = driver.call("generate", request=request_json(PROMPT, adapter=adapter, temperature=0.0,
                                                               max_new_tokens=TOKENS, ignore_eos=True))
            assert got["error"] is None and got["token_ids"] == expected[adapter], (lang, adapter)
        bad = driver.call("generate", request=request_json(PROMPT, adapter="nope", max_new_tokens=2))
        assert (bad["error"]["code"], bad["error"]["field"]) == ("NOT_FOUND", "adapter")
        refused = driver.call("load_adapter", name="x", path=str(tmp_path))
        assert (refused["error"]["code"], refused["error"]["field"]) == ("INVALID_ARGUMENT", "lora_path")
        missing = driver.call("unload_adapter", name="never-loaded")
        assert (missing["error"]["code"], missing["error"]["field"]) == ("NOT_FOUND", "lora_name")
    finally:
        driver.close()
