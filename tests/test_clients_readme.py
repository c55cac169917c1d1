"""Every Python, Go and Java snippet of README.md and the clients' READMEs, compiled and run against a real server,
and the Java library jar as a library (only our packages, no Main-Class or Class-Path).

Snippets are found by their fence tag `pagedserve-test:<name>`; an untagged python/go/java/xml block fails the
test, so no snippet can escape. The one edit made to any snippet: the address `localhost:50051` becomes the test
server's. The downstream Go module and Maven project are created from clients/go/README.md and
clients/java/README.md exactly as written there and must print the Python client's greedy completion.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from service_fixtures import shared_server  # noqa: F401 - fixture used by name
from test_clients_go_java import JAVA_LIB, _missing, built_clients  # noqa: F401 - fixture used by name

from pagedserve.client import Client, Message

ROOT = Path(__file__).resolve().parents[1]
READMES = (ROOT / "README.md", ROOT / "clients" / "go" / "README.md", ROOT / "clients" / "java" / "README.md")
CHECKED_LANGS = {"python", "go", "java", "xml"}
DOC_ADDRESS = "localhost:50051"
FENCE = re.compile(r"^```(\S*)([^\n]*)\n(.*?)^```", re.S | re.M)
TAG = re.compile(r"pagedserve-test:(\S+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
toolchains = pytest.mark.skipif(bool(_missing), reason=f"Go/Java toolchains absent ({', '.join(_missing)})")

GO_FRAGMENT_HARNESS = """package main

import (
	"context"
	"fmt"

	"github.com/pagedserve/pagedserve/clients/go/client"
	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

// readmeFragment holds README.md's Go snippet so that the module's build type-checks it.
func readmeFragment(ctx context.Context, req *pb.GenerateRequest) error {
%s}

// readmeStructured holds README.md's structured-output snippet.
func readmeStructured(ctx context.Context, c *client.Client) error {
%s}

// readmeLora holds README.md's LoRA snippet.
func readmeLora(ctx context.Context, c *client.Client) error {
%s}

var _, _, _, _, _ = readmeFragment, readmeStructured, readmeLora, fmt.Print, client.Dial
"""

JAVA_FRAGMENT_HARNESS = """package example;

import dev.pagedserve.client.*;
import dev.pagedserve.v1.*;
import java.time.Duration;

/** README.md's Java snippet, compiled with the downstream project. */
final class ReadmeFragment {
  private ReadmeFragment() {}

  static void run(GenerateRequest request) {
%s  }

  static void structured(PagedServeClient client) {
%s  }

  static void lora(PagedServeClient client) {
%s  }
}
"""


def snippets() -> dict[str, str]:
    found: dict[str, str] = {}
    for readme in READMES:
        for lang, info, body in FENCE.findall(readme.read_text()):
            tag = TAG.search(info)
            if tag is None:
                assert lang not in CHECKED_LANGS, f"{readme.name}: untagged {lang} snippet:\n{body[:300]}"
                continue
            assert tag.group(1) not in found, f"snippet tag {tag.group(1)} used twice"
            found[tag.group(1)] = body
    return found


SNIPPETS = snippets()


def test_every_snippet_is_tagged_and_used():
    used = {"python-client", "python-offline", "python-openai", "python-structured", "python-openai-structured",
            "go-fragment", "go-structured", "go-main", "go-recipe", "java-fragment", "java-structured", "java-pom",
            "java-main", "java-recipe", "python-lora", "go-lora", "java-lora"}  # python-lora: test_lora_surfaces.py
    assert set(SNIPPETS) == used


@pytest.fixture(scope="module")
def expected(shared_server) -> dict[str, str]:  # noqa: F811
    with Client(shared_server.target, timeout=300) as client:
        return {"readme": client.complete("The capital of France is", max_new_tokens=32, temperature=0).text,
                "program": client.complete("The capital of France is", max_new_tokens=24, temperature=0,
                                           ignore_eos=True).text}


def _indent(code: str, prefix: str) -> str:
    return "".join(f"{prefix}{line}\n" if line else "\n" for line in code.splitlines())


def at(target: str, code: str) -> str:
    assert DOC_ADDRESS in code
    return code.replace(DOC_ADDRESS, target)


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    done = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_python_client_snippet(shared_server, expected, tmp_path):  # noqa: F811
    out = run([sys.executable, "-c", at(shared_server.target, SNIPPETS["python-client"])], tmp_path)
    assert out == expected["readme"] and out


def test_python_openai_sdk_snippet(shared_server, tmp_path):  # noqa: F811
    """README's OpenAI SDK call, against the shared server's HTTP port: the same answer as the gRPC chat."""
    code = SNIPPETS["python-openai"]
    assert "localhost:8000" in code
    out = run([sys.executable, "-c", code.replace("localhost:8000", f"127.0.0.1:{shared_server.http_port}")], tmp_path)
    with Client(shared_server.target, timeout=300) as client:
        answer = client.complete([Message("user", "What is the capital of France?")], temperature=0,
                                 max_new_tokens=64)
    assert answer.final.finish_reason.value == "eos_token", "the answer ends before either length limit"
    assert out == answer.text + "\n" and "Paris" in out


def test_python_structured_snippet(shared_server, tmp_path):  # noqa: F811
    """The typed constraints: a choice that is one of its strings, a regex the whole output matches."""
    answer, phone = run([sys.executable, "-c", at(shared_server.target, SNIPPETS["python-structured"])],
                        tmp_path).splitlines()
    assert answer in ("yes", "no") and re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone), (answer, phone)


def test_python_openai_structured_snippet(shared_server, tmp_path):  # noqa: F811
    """README's response_format and forced tool call through the OpenAI SDK: a person and a get_weather call."""
    code = SNIPPETS["python-openai-structured"].replace("localhost:8000", f"127.0.0.1:{shared_server.http_port}")
    person, call = run([sys.executable, "-c", code], tmp_path).splitlines()
    person = ast.literal_eval(person)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and len(person["name"]) <= 20
    name, arguments = call.split(" ", 1)
    assert name == "get_weather" and isinstance(ast.literal_eval(arguments)["city"], str)


def test_python_offline_api_snippet(tmp_path):
    out = run([sys.executable, "-c", SNIPPETS["python-offline"]], tmp_path, env={"OMP_NUM_THREADS": "2"})
    assert len(out.splitlines()) == 1 and out.strip()


def test_go_recipe_pins_match_the_client_go_mod():
    go_mod = (ROOT / "clients" / "go" / "go.mod").read_text()
    pins = re.findall(r"^\t(\S+) (v\S+)", go_mod, re.M)
    assert len(pins) == 7
    for module, version in pins:
        assert f"-require={module}@{version}" in SNIPPETS["go-recipe"]
        assert module in SNIPPETS["go-recipe"].split("for module in", 1)[1]


@toolchains
def test_downstream_go_module_from_the_readme(built_clients, shared_server, expected, tmp_path):  # noqa: F811
    (tmp_path / "main.go").write_text(SNIPPETS["go-main"])
    snippets = tuple(_indent(SNIPPETS[name], "\t") for name in ("go-fragment", "go-structured", "go-lora"))
    (tmp_path / "readme_fragment.go").write_text(GO_FRAGMENT_HARNESS % snippets)
    recipe = at(shared_server.target, SNIPPETS["go-recipe"])
    env = {"PAGEDSERVE": str(ROOT), "GOFLAGS": "", "GOPROXY": "off"}
    out = run(["bash", "-euo", "pipefail", "-c", recipe], tmp_path, env)
    assert out == expected["program"] and out


@toolchains
def test_downstream_maven_project_from_the_readme(built_clients, shared_server, expected, tmp_path):  # noqa: F811
    (tmp_path / "pom.xml").write_text(SNIPPETS["java-pom"])
    src = tmp_path / "src" / "main" / "java" / "example"
    src.mkdir(parents=True)
    (src / "Hello.java").write_text(SNIPPETS["java-main"])
    snippets = tuple(_indent(SNIPPETS[name], "    ") for name in ("java-fragment", "java-structured", "java-lora"))
    (src / "ReadmeFragment.java").write_text(JAVA_FRAGMENT_HARNESS % snippets)
    recipe = at(shared_server.target, SNIPPETS["java-recipe"])
    out = run(["bash", "-euo", "pipefail", "-c", recipe], tmp_path, {"PAGEDSERVE": str(ROOT)})
    # Debian's Maven 3.8 writes ANSI resets around its (quiet, batch-mode) output even with no terminal.
    assert ANSI.sub("", out) == expected["program"] and out


@toolchains
def test_java_library_jar_holds_only_our_packages(built_clients):  # noqa: F811
    with zipfile.ZipFile(JAVA_LIB) as jar:
        names = [n for n in jar.namelist() if not n.endswith("/")]
        manifest = jar.read("META-INF/MANIFEST.MF").decode()
    ours = ("dev/pagedserve/client/", "dev/pagedserve/v1/", "META-INF/maven/dev.pagedserve/pagedserve-client/")
    strays = [n for n in names if n != "META-INF/MANIFEST.MF" and not n.startswith(ours)]
    assert strays == []
    assert any(n.startswith("dev/pagedserve/v1/GenerationServiceGrpc") for n in names)
    assert any(n.startswith("dev/pagedserve/client/health/v1/HealthGrpc") for n in names)
    assert not any("/examples/" in n or "/conformance/" in n for n in names)
    assert "Class-Path" not in manifest and "Main-Class" not in manifest
