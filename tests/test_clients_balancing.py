"""Client-side load balancing: each client (Python, Go, Java) given two replicas as one target spreads 32
concurrent streams over both (round_robin, the default service config of all three clients).

The replicas are real `pagedserve serve` processes on loopback: the shared server and one more. Python gets an
address list (which it turns into gRPC's "ipv4:a,b" target); Go and Java get that same "ipv4:" target, which
both resolve per connection. Each replica's share is read from its own Prometheus counter of finished requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from service_fixtures import ServerProcess, metric_value, shared_server, start_server  # noqa: F401
from test_clients_go_java import Driver, _missing, built_clients, request_json  # noqa: F401 - fixture by name

from pagedserve.client import Client
from pagedserve.client.channels import resolve_target

STREAMS = 32
OPTIONS = dict(temperature=0.0, max_new_tokens=4, ignore_eos=True)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def replicas(shared_server, tmp_path_factory) -> Iterator[list[ServerProcess]]:  # noqa: F811
    second = start_server(tmp_path_factory.mktemp("replica-b"))
    yield [shared_server, second]
    second.stop()


def finished(replicas: list[ServerProcess]) -> list[float]:
    return [metric_value(r, "vllm:request_success_total") for r in replicas]


def addresses(replicas: list[ServerProcess]) -> list[str]:
    return [f"127.0.0.1:{r.port}" for r in replicas]


def assert_spread(before: list[float], replicas: list[ServerProcess]) -> None:
    served = [after - b for after, b in zip(finished(replicas), before)]
    assert sum(served) == STREAMS, served
    assert all(n > 0 for n in served), f"one replica served every stream: {served}"


def test_python_client_spreads_streams_over_an_address_list(replicas):
    with Client(addresses(replicas), timeout=300) as client:
        expected = client.complete(PROMPT, **OPTIONS).text
        before = finished(replicas)
        with ThreadPoolExecutor(STREAMS) as pool:
            texts = list(pool.map(lambda _: client.complete(PROMPT, **OPTIONS).text, range(STREAMS)))
    assert texts == [expected] * STREAMS
    assert_spread(before, replicas)


@pytest.mark.skipif(bool(_missing), reason=f"Go/Java toolchains absent ({', '.join(_missing)})")
@pytest.mark.parametrize("lang", ["go", "java"])
def test_go_and_java_clients_spread_streams_over_an_ipv4_target(lang, built_clients, replicas, tmp_path):
    driver = Driver(lang, "ipv4:" + ",".join(addresses(replicas)), tmp_path)
    try:
        # A service's client is long-lived: round_robin starts connecting to every replica at the first call but
        # sends calls only to connections already up, so a cold start would pin the whole first burst to one.
        warm = driver.call("generate_many", request=request_json(PROMPT, **OPTIONS), count=4)["results"]
        assert [r["error"] for r in warm] == [None] * 4
        before = finished(replicas)
        got = driver.call("generate_many", request=request_json(PROMPT, **OPTIONS), count=STREAMS)["results"]
    finally:
        driver.close()
    assert [r["error"] for r in got] == [None] * STREAMS
    assert len({r["text"] for r in got}) == 1
    assert_spread(before, replicas)


def test_python_address_lists_become_grpc_targets_and_names_are_refused():
    assert resolve_target(["10.0.0.1:50051", "10.0.0.2:50051"]) == "ipv4:10.0.0.1:50051,10.0.0.2:50051"
    assert resolve_target(["[::1]:50051", "[fd00::2]:50051"]) == "ipv6:[::1]:50051,[fd00::2]:50051"
    assert resolve_target("dns:///pagedserve-headless:50051") == "dns:///pagedserve-headless:50051"
    for bad, message in ((["pagedserve-0:50051"], "dns:///"), (["10.0.0.1:50051", "[::1]:1"], "mixed"),
                         ([], "empty"), (["10.0.0.1"], "not ip:port")):
        with pytest.raises(ValueError, match=message):
            resolve_target(bad)
    with pytest.raises(ValueError, match="load_balancing"):
        Client("localhost:1", load_balancing="random")
