"""docs/vllm-compatibility.md's table, row by row, against a real server: a request parameter that "works" is
answered 200 (streamed or not), one "refused" is a 400 naming it; an endpoint that works answers 200; a flag that
works is in `serve --help`, one refused stops the command line naming it."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import requests
from service_fixtures import start_server

from pagedserve.service.cli import build_parser

DOC = Path(__file__).resolve().parent.parent / "docs" / "vllm-compatibility.md"
MODEL = "SmolLM2-135M-Instruct"
BASES = {"chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
         "completions": ("/v1/completions", {"model": MODEL, "prompt": "Hi"})}


def rows() -> list[tuple[str, str, str, bool]]:
    """(vLLM name, kind, probe, works) for each table row."""
    table = DOC.read_text().split("## The table", 1)[1]
    out = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("vLLM", "---") or set(cells[0]) <= {"-"}:
            continue
        name, kind, probe, verdict = cells
        assert verdict.startswith(("works", "refused")), line
        out.append((name.strip("`"), kind, probe.strip("`"), verdict.startswith("works")))
    return out


ROWS = rows()


def test_the_table_covers_each_kind():
    kinds = {kind for _, kind, _, _ in ROWS}
    assert kinds == {"chat", "completions", "endpoint", "flag"} and len(ROWS) > 90


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("compat"), "--http-port", "0", "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes")
    yield server
    server.stop()


@pytest.mark.parametrize(("name", "kind", "probe", "works"), [r for r in ROWS if r[1] in BASES],
                         ids=[f"{r[1]}:{r[0]}" for r in ROWS if r[1] in BASES])
def test_request_row(server, name, kind, probe, works):
    path, base = BASES[kind]
    body = {**base, "max_tokens": 3, "temperature": 0, **json.loads(probe)}
    reply = requests.post(f"{server.http_url}{path}", json=body, timeout=300)
    if works:
        assert reply.status_code == 200, reply.text
        if body.get("stream"):
            assert reply.text.rstrip().endswith("data: [DONE]")
        return
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == name.split(" ")[0], reply.text


@pytest.mark.parametrize("probe", [r[2] for r in ROWS if r[1] == "endpoint"])
def test_endpoint_row(server, probe):
    method, path, *body = probe.split(" ", 2)
    reply = requests.request(method, f"{server.http_url}{path}", json=json.loads(body[0]) if body else None,
                             timeout=120)
    assert reply.status_code == 200, reply.text


def _help() -> str:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return serve.format_help()


@pytest.mark.parametrize(("name", "probe", "works"), [(r[0], r[2], r[3]) for r in ROWS if r[1] == "flag"],
                         ids=[r[0] for r in ROWS if r[1] == "flag"])
def test_flag_row(name, probe, works):
    if works:
        assert re.search(rf"(?<![\w-]){re.escape(probe)}(?![\w-])", _help()), probe
        return
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", probe, "1"])
    assert exited.value.code == 2 and probe in stderr.getvalue()
