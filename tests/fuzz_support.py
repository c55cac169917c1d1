"""Shared pieces of the fuzz suites (test_fuzz_grpc.py: pagedserve.v1 + raw bytes on every RPC; test_fuzz_http.py:
OpenAI HTTP generation; test_fuzz_pooling.py: embeddings, scoring and tokenizing over HTTP; test_fuzz_vllm.py: the
router protocol; test_fuzz_engine_api.py: AsyncEngine's API in process): hypothesis settings with a CI budget, JSON
strategies, and the verdict on one response.

Budget: PAGEDSERVE_FUZZ_EXAMPLES (default 25 per property) is read when a suite asks for its settings, never at
import. `PAGEDSERVE_FUZZ_EXAMPLES=2000 bash tests/run.sh -k fuzz` runs a long campaign; the default keeps the
whole fuzz suite near a minute on two cores. Runs are derandomized (hypothesis seeds from the test's name), so
the same budget replays the same inputs in CI and on a laptop. PAGEDSERVE_FUZZ_FRESH=1 draws from a random seed
instead, so a campaign explores past what every earlier one replayed; a failure prints the blob that replays it
(`@reproduce_failure`), and `--hypothesis-seed=N` picks the seed.
"""

from __future__ import annotations

import http.client
import json
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service_fixtures import engine_idle, health, model_info, wait_until

# Codes a request may end with; anything else (UNKNOWN, INTERNAL, ...) is a bug the fuzzer reports.
DOCUMENTED_CODES = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED,
}
# "field.path: message" or "field.path[3].sub: message"; INVALID_ARGUMENT must name the field this way.
_FIELD_PREFIX = re.compile(r"^(?P<field>[a-z_][a-z0-9_\-]*(\[\d+\])?(\.[a-z_][a-z0-9_]*(\[\d+\])?)*): ")


DEFAULT_EXAMPLES = 25
ANY_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6)
HTTP_STATUSES = {200, 400, 404, 413, 429}  # what OpenAI's and vLLM's routes answer; never 5xx


def plausible(*values) -> st.SearchStrategy:
    """One of the values a client would send, or any JSON at all (a wrong type, an absurd number)."""
    return st.one_of(st.sampled_from(values), ANY_JSON)


def fuzz_examples() -> int:
    return int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", str(DEFAULT_EXAMPLES)))


def campaign_timeout_s(default_s: float) -> float | None:
    """pytest-timeout's limit for a fuzz test under a longer campaign: the suite's limit scaled by the examples over
    the default budget (1000 examples ran one gRPC property past the plain 600 s), None at the default budget."""
    examples = fuzz_examples()
    return default_s * examples / DEFAULT_EXAMPLES if examples > DEFAULT_EXAMPLES else None


def fresh_inputs() -> bool:
    return os.environ.get("PAGEDSERVE_FUZZ_FRESH", "") not in ("", "0")


def fuzz_settings() -> settings:
    examples = fuzz_examples()
    return settings(
        max_examples=examples, derandomize=not fresh_inputs(), database=None, deadline=None, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


def named_field(details: str) -> str | None:
    match = _FIELD_PREFIX.match(details or "")
    return match.group("field") if match else None


def check_outcome(code: grpc.StatusCode, details: str, known_top_level: set[str]) -> None:
    """One request's status must be documented, and INVALID_ARGUMENT must name a real request field."""
    assert code in DOCUMENTED_CODES, f"undocumented status {code.name}: {details}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field = named_field(details)
        assert field is not None, f"INVALID_ARGUMENT without a field: {details!r}"
        top = re.split(r"[.\[]", field, maxsplit=1)[0]
        assert top in known_top_level, f"INVALID_ARGUMENT names {field!r}, not a request field: {details!r}"


def check_http_status(body: dict, status: int, payload: bytes) -> None:
    """A documented status; an error carries a message, and a 400 names a parameter the body has (`error.param`,
    whose top level is a key of the body)."""
    assert status in HTTP_STATUSES, f"HTTP {status} for {body!r}: {payload[:300]!r}"
    if status == 200:
        return
    error = json.loads(payload)["error"]
    assert error["message"], payload
    if status == 400:
        param = error["param"]
        assert isinstance(param, str) and param, f"400 without a parameter for {body!r}: {payload[:300]!r}"
        assert re.split(r"[.\[]", param, maxsplit=1)[0] in body, f"400 names {param!r}, not in the body"


def run_beside_a_bystander(run: Callable[[], None], pool: ThreadPoolExecutor, channel: grpc.Channel) -> None:
    """Runs a property (its examples share `pool`), then checks what every fuzz suite requires of the server
    afterwards: no KV block held by any request, health still SERVING."""
    try:
        run()
    finally:
        pool.shutdown()
    info = model_info(channel)
    assert info.kv_cache.used_blocks == 0 and info.kv_cache.free_blocks == info.kv_cache.total_blocks
    assert health(channel) == health_pb2.HealthCheckResponse.SERVING


def post(port: int, path: str, data: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, data, {"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def garbage_never_breaks_the_route(port: int, path: str, channel: grpc.Channel, probe: tuple[str, dict]) -> None:
    """Random bytes POSTed to `path` never get a 5xx; afterwards no request is left in the engine and the probe
    (a route and a valid body) still answers 200."""
    @fuzz_settings()
    @given(st.binary(max_size=512))
    def run(payload: bytes) -> None:
        status, reply = post(port, path, payload)
        assert status < 500, f"HTTP {status} for {payload!r}: {reply[:300]!r}"

    run()
    wait_until(lambda: engine_idle(channel), 60, "garbage requests to leave the engine")
    assert post(port, probe[0], json.dumps(probe[1]).encode())[0] == 200
