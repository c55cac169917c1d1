"""The Go and Java clients against a real server: same text as the Python client, cancel, deadline, errors,
health, 16 concurrent streams on one connection, and mutual TLS.

Both languages are driven through their conformance drivers (clients/go/cmd/pagedserve-conformance and
dev.pagedserve.client.conformance.ConformanceDriver): one long-lived process per language holding one client,
speaking JSON lines. Requests are sent as protobuf JSON of the very proto the Python client builds, so all three
languages send the same request. The toolchains come from Debian packages that clients/build.sh installs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from service_fixtures import (  # noqa: F401 - shared_server is a fixture used by name
    ServerProcess,
    engine_idle,
    metric_value,
    shared_server,
    start_server,
    wait_until,
)

from pagedserve.client import Choice, Client, ClientError, GenerateOptions, JsonSchema, Message, Regex, TlsOptions
from pagedserve.client import build_request

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = ROOT / "clients"
GO_BUILD = CLIENTS / "go" / "build"
JAVA_LIB = CLIENTS / "java" / "target" / "pagedserve-client-0.1.0.jar"
JAVA_JAR = CLIENTS / "java" / "examples" / "target" / "pagedserve-client-examples.jar"
ARTIFACTS = (GO_BUILD / "pagedserve-go", GO_BUILD / "pagedserve-conformance", JAVA_LIB, JAVA_JAR)
TOOLS = ("go", "java", "mvn", "protoc", "protoc-gen-go", "protoc-gen-go-grpc", "grpc_java_plugin")
DEBIAN_LIBS = (Path("/usr/share/gocode/src/google.golang.org/grpc"), Path("/usr/share/maven-repo/io/grpc/grpc-netty"))
LANGS = ("go", "java")

PROMPT = "The capital of France is"
GREEDY = dict(temperature=0.0, max_new_tokens=24, ignore_eos=True)

_missing = [t for t in TOOLS if shutil.which(t) is None] + [str(p) for p in DEBIAN_LIBS if not p.is_dir()]
pytestmark = pytest.mark.skipif(
    bool(_missing), reason=f"Go/Java toolchains absent ({', '.join(_missing)}); clients/build.sh installs them")


def _sources() -> Iterator[Path]:
    yield from (CLIENTS / "go").rglob("*.go")
    yield from (CLIENTS / "java").rglob("src/**/*.java")
    yield from (CLIENTS / "go" / "go.mod", CLIENTS / "java" / "pom.xml", CLIENTS / "java" / "examples" / "pom.xml")
    yield from (ROOT / "proto" / "pagedserve" / "v1").glob("*.proto")


@pytest.fixture(scope="session")
def built_clients() -> None:
    """Builds with clients/build.sh (no apt) unless CI already did and nothing changed since."""
    newest_source = max(p.stat().st_mtime for p in _sources())
    if all(a.exists() and a.stat().st_mtime >= newest_source for a in ARTIFACTS):
        return
    done = subprocess.run([str(CLIENTS / "build.sh"), "--no-install"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"clients/build.sh failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def driver_command(lang: str, target: str) -> list[str]:
    if lang == "go":
        return [str(GO_BUILD / "pagedserve-conformance"), "-addr", target]
    return ["java", "-cp", str(JAVA_JAR), "dev.pagedserve.examples.ConformanceDriver", "--addr", target]


class Driver:
    """One conformance-driver process: one client, one connection, one JSON command per call."""

    def __init__(self, lang: str, target: str, workdir: Path):
        self.lang = lang
        self.stderr_path = workdir / f"{lang}-driver.stderr"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(driver_command(lang, target), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, encoding="utf-8", bufsize=1, cwd=workdir)

    def call(self, op: str, **fields: object) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"{self.lang} driver exited ({self.proc.poll()}): {self.stderr_path.read_text()[-3000:]}"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module", params=LANGS)
def driver(request, built_clients, shared_server, tmp_path_factory) -> Iterator[Driver]:  # noqa: F811
    d = Driver(request.param, shared_server.target, tmp_path_factory.mktemp(f"{request.param}-driver"))
    yield d
    d.close()


@pytest.fixture(scope="module")
def py_client(shared_server) -> Iterator[Client]:  # noqa: F811
    with Client(shared_server.target, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def channel(shared_server) -> Iterator[grpc.Channel]:  # noqa: F811
    with grpc.insecure_channel(shared_server.target) as ch:
        yield ch


def request_json(prompt: str | list[Message], **options: object) -> dict:
    """The exact GenerateRequest the Python client sends for these options, as protobuf JSON."""
    return json_format.MessageToDict(build_request(prompt, GenerateOptions(**options)))


def test_greedy_stream_matches_python_client(driver, py_client):
    expected = py_client.complete(PROMPT, **GREEDY)
    got = driver.call("generate", request=request_json(PROMPT, **GREEDY))
    assert got["error"] is None
    assert got["text"] == expected.text and len(expected.text) > 0
    assert got["token_ids"] == expected.token_ids
    assert got["finish_reason"] == "FINISH_REASON_MAX_TOKENS"


def test_chat_messages_match_python_client(driver, py_client):
    """GenerateRequest.chat through each language's generated types: the same answer as the Python client's."""
    messages = [Message("user", "Hello!"), Message("assistant", "Hi! How can I help?"),
                Message("user", "What is the capital of France?")]
    expected = py_client.complete(messages, temperature=0.0, max_new_tokens=16)
    request = request_json(messages, temperature=0.0, max_new_tokens=16)
    assert request["chat"]["messages"][2]["role"] == "user"
    got = driver.call("generate", request=request)
    assert got["error"] is None
    assert got["text"] == expected.text and "Paris" in expected.text
    assert got["token_ids"] == expected.token_ids


def test_cancel_after_k_tokens_frees_the_request(driver, channel, shared_server):  # noqa: F811
    # The engine counts requests it aborted: the count rising proves the cancel (not the request running out
    # of tokens) freed it, whatever the machine's speed.
    aborted = metric_value(shared_server, "pagedserve:requests_aborted_total")
    request = request_json("Once upon a time", temperature=0.0, max_new_tokens=480, ignore_eos=True)
    got = driver.call("generate", request=request, cancel_after_tokens=3)
    assert got["cancelled"] and 3 <= got["tokens_received"] < 480
    assert got["error"]["code"] == "CANCELLED"
    assert driver.proc.poll() is None, "the client (and its connection) stays up; the cancel alone must free it"
    wait_until(lambda: engine_idle(channel), 30, "the server to free the cancelled request's KV blocks")
    assert metric_value(shared_server, "pagedserve:requests_aborted_total") == aborted + 1


def test_expired_deadline_is_deadline_exceeded(driver, channel):
    request = request_json("Once upon a time", temperature=0.0, max_new_tokens=480, ignore_eos=True)
    got = driver.call("generate", request=request, timeout_ms=300)
    assert got["error"]["code"] == "DEADLINE_EXCEEDED"
    assert got["tokens_received"] < 480
    wait_until(lambda: engine_idle(channel), 30, "the server to free the expired request")


@pytest.mark.parametrize("options, field", [
    (dict(top_p=2.0), "sampling.top_p"),
    (dict(temperature=-1.0), "sampling.temperature"),
    (dict(max_new_tokens=100_000), "stopping.max_new_tokens"),
    (dict(constraint=Regex("")), "constraint.regex"),
    (dict(constraint=JsonSchema("[1]")), "constraint.json_schema"),
    (dict(constraint=Choice(["yes", ""])), "constraint.choice.choices[1]"),
])
def test_invalid_argument_names_the_field(driver, py_client, options, field):
    with pytest.raises(ClientError) as python_error:
        py_client.complete(PROMPT, **options)
    got = driver.call("generate", request=request_json(PROMPT, **options))
    assert got["error"]["code"] == "INVALID_ARGUMENT"
    assert got["error"]["field"] == field == python_error.value.field
    assert field in got["error"]["message"]


@pytest.mark.parametrize("constraint, check", [
    (Choice(["yes", "no", "maybe"]), lambda text: text in ("yes", "no", "maybe")),
    (Regex(r"[0-9]{3}-[0-9]{4}"), lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)),
    (JsonSchema({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                 "additionalProperties": False}), lambda text: isinstance(json.loads(text)["ok"], bool)),
], ids=["choice", "regex", "json_schema"])
def test_constrained_generation_matches_python_client(driver, py_client, constraint, check):
    """The constraint oneof travels through each language's generated types: the same constrained answer."""
    options = dict(temperature=0.0, max_new_tokens=48, constraint=constraint)
    expected = py_client.complete("Is Paris in France? Answer:", **options)
    got = driver.call("generate", request=request_json("Is Paris in France? Answer:", **options))
    assert got["error"] is None
    assert got["text"] == expected.text and check(expected.text), expected.text
    assert got["finish_reason"] == "FINISH_REASON_EOS_TOKEN"


def test_health_check(driver):
    for service in ("", "pagedserve.v1.GenerationService"):
        got = driver.call("health", service=service)
        assert (got["status"], got["error"]) == ("SERVING", None)
    unknown = driver.call("health", service="no.such.Service")
    assert unknown["error"]["code"] == "NOT_FOUND"


def test_sixteen_concurrent_streams_on_one_client(driver, py_client):
    options = dict(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    expected = py_client.complete(PROMPT, **options)
    got = driver.call("generate_many", request=request_json(PROMPT, **options), count=16)["results"]
    assert len(got) == 16
    assert [r["error"] for r in got] == [None] * 16
    assert len({r["request_id"] for r in got}) == 16
    assert all(r["finish_reason"] == "FINISH_REASON_MAX_TOKENS" for r in got)
    assert [r["text"] for r in got] == [expected.text] * 16


# --- the example commands, over mutual TLS ----------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for localhost / 127.0.0.1, and a client certificate (PKCS#8 keys)."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca",
             cwd=d)
    for name, ext in (("server", "subjectAltName=DNS:localhost,IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return {name: d / name for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory) -> Iterator[tuple[ServerProcess, dict[str, Path]]]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI absent (Debian package openssl) to make test certificates")
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    server = start_server(tmp_path_factory.mktemp("mtls-server"), "--tls-cert", str(certs["server.pem"]),
                          "--tls-key", str(certs["server.key"]), "--tls-client-ca", str(certs["ca.pem"]))
    yield server, certs
    server.stop()


def example_command(lang: str, target: str, prompt: str, tls: dict[str, Path]) -> list[str]:
    args = {"addr": target, "prompt": prompt, "temperature": "0", "max-new-tokens": "16",
            **{k: str(v) for k, v in tls.items()}}
    if lang == "go":
        return [str(GO_BUILD / "pagedserve-go"), *(x for k, v in args.items() for x in (f"-{k}", v))]
    return ["java", "-jar", str(JAVA_JAR), *(x for k, v in args.items() for x in (f"--{k}", v))]


@pytest.mark.parametrize("lang", LANGS)
def test_example_streams_a_completion_over_mutual_tls(lang, built_clients, mtls_server):
    server, certs = mtls_server
    tls = {"ca": certs["ca.pem"], "cert": certs["client.pem"], "key": certs["client.key"]}
    with Client(server.target, timeout=120, tls=TlsOptions(tls["ca"], tls["cert"], tls["key"])) as client:
        expected = client.complete(PROMPT, temperature=0.0, max_new_tokens=16)
    done = subprocess.run(example_command(lang, server.target, PROMPT, tls), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected.text and len(expected.text) > 0
    assert "FINISH_REASON_" in done.stderr


@pytest.mark.parametrize("lang", LANGS)
def test_example_without_client_certificate_is_rejected(lang, built_clients, mtls_server):
    server, certs = mtls_server
    done = subprocess.run(example_command(lang, server.target, PROMPT, {"ca": certs["ca.pem"]}), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1
    assert "UNAVAILABLE" in done.stderr and done.stdout == ""


def test_go_stubs_are_fresh():
    """clients/go/pagedservev1 is committed; it must match the protos (python proto/generate.py --lang go)."""
    done = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check", "--lang", "go"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
