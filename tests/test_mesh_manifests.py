"""deploy/k8s validates against Kubernetes' own schemas and agrees with the server's CLI; deploy/envoy renders to
a config the real Envoy binary accepts."""

from __future__ import annotations

import copy
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from mesh_fixtures import RENDER, envoy_binary
from service_fixtures import shared_server  # noqa: F401 - fixture used by name

from pagedserve.service.cli import build_parser, server_config
from pagedserve.service.core.lifecycle import LIVENESS_SERVICE

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
K8S_VERSION = "1.37.0"  # the newest schema set kubernetes-validate 1.37.0 ships (offline)


def documents() -> list[dict]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> list[dict]:
    return [d for d in documents() if d["kind"] == kind]


def container() -> dict:
    [deployment] = by_kind("Deployment")
    [server] = deployment["spec"]["template"]["spec"]["containers"]
    return server


def serve_args() -> list[str]:
    args = container()["args"]
    assert args[0] == "serve"
    return args


@pytest.mark.parametrize("doc", [d for d in documents() if d["kind"] != "InferencePool"],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_builtin_kinds_validate_against_kubernetes_schemas(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_validation_is_real_it_rejects_an_unknown_field():
    broken = copy.deepcopy(by_kind("Deployment")[0])
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 50051}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_every_flag_in_the_manifest_is_in_serve_help_and_parses():
    help_text = subprocess.run([sys.executable, "-m", "pagedserve.service", "serve", "--help"], check=True,
                               capture_output=True, text=True, timeout=120).stdout
    flags = [a.split("=", 1)[0] for a in serve_args()[1:] if a.startswith("--")]
    assert flags and all(f" {flag}" in help_text for flag in flags), [f for f in flags if f not in help_text]
    server_config(build_parser().parse_args(serve_args()))  # the values are valid too (ConfigError otherwise)


def test_probe_and_service_ports_match_the_server_arguments():
    config = server_config(build_parser().parse_args(serve_args()))
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports == {"grpc": config.port, "metrics": config.metrics_port}
    server = container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["grpc"]["port"] == config.port, probe
    assert server["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE  # stays SERVING while draining
    assert "service" not in server["readinessProbe"]["grpc"]  # "": NOT_SERVING from SIGTERM on
    assert config.host == "0.0.0.0", "a pod must listen beyond loopback"
    annotations = by_kind("Deployment")[0]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == config.metrics_port
    for service in by_kind("Service"):
        grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
        assert grpc_port["targetPort"] in ports and grpc_port["appProtocol"] == "kubernetes.io/h2c"
        assert grpc_port["port"] == config.port


def test_termination_grace_covers_prestop_drain_delay_and_shutdown_grace():
    config = server_config(build_parser().parse_args(serve_args()))
    spec = by_kind("Deployment")[0]["spec"]["template"]["spec"]
    pre_stop = container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    needed = pre_stop + config.drain_delay_s + config.shutdown_grace_s
    assert needed + 5 <= spec["terminationGracePeriodSeconds"], (needed, spec["terminationGracePeriodSeconds"])
    assert config.max_connection_age_s is not None, "client-side balancing needs connections to age out"


def test_selectors_pick_the_deployments_pods():
    labels = by_kind("Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    selectors = [s["spec"]["selector"] for s in by_kind("Service")]
    selectors += [d["spec"]["selector"]["matchLabels"] for d in by_kind("PodDisruptionBudget") + by_kind("InferencePool")]
    assert selectors and all(sel.items() <= labels.items() for sel in selectors)
    [headless] = [s for s in by_kind("Service") if s["spec"].get("clusterIP") == "None"]
    assert headless["metadata"]["name"] == "pagedserve-headless"
    [hpa] = by_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == by_kind("Deployment")[0]["metadata"]["name"]


def test_inference_pool_structure():
    """A CRD kubernetes-validate has no schema for: the fields the Gateway API Inference Extension v1 requires."""
    [pool] = by_kind("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    config = server_config(build_parser().parse_args(serve_args()))
    assert [p["number"] for p in spec["targetPorts"]] == [config.port]
    assert spec["appProtocol"] == "kubernetes.io/h2c"
    assert spec["endpointPickerRef"]["name"] and 0 < spec["endpointPickerRef"]["port"]["number"] < 65536


def test_hpa_metric_is_one_the_server_exports(shared_server):  # noqa: F811
    [hpa] = by_kind("HorizontalPodAutoscaler")
    [metric] = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    body = urllib.request.urlopen(f"http://127.0.0.1:{shared_server.metrics_port}/metrics", timeout=30).read()
    assert f"\n{name}{{".encode() in body


@pytest.mark.parametrize("dns", [False, True], ids=["static", "strict-dns"])
def test_rendered_envoy_config_is_accepted_by_envoy(tmp_path, dns):
    config = tmp_path / "envoy.yaml"
    replicas = ["pagedserve-headless.default.svc:50051"] if dns else ["127.0.0.1:50051", "127.0.0.1:50052"]
    subprocess.run([sys.executable, str(RENDER), *[a for r in replicas for a in ("--replica", r)],
                    *(["--dns"] if dns else []), "-o", str(config)], check=True, timeout=60)
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(config), "--disable-hot-restart"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


REPO = K8S.parent.parent


def test_containerfile_installs_what_the_readme_installs_and_copies_every_package():
    readme = (REPO / "README.md").read_text()
    first = next(line for line in readme.splitlines() if line.startswith("pip install torch"))
    install = first.removesuffix(" && pagedserve serve")
    containerfile = (REPO / "deploy" / "Containerfile").read_text()
    assert f"RUN {install}\n" in containerfile
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    copied = [line.split()[1] for line in containerfile.splitlines() if line.startswith("COPY ")]
    missing = [src for src in package_dirs.values() if not any(src == c or src.startswith(c + "/") for c in copied)]
    assert not missing, f"Containerfile does not COPY {missing}"
    assert "USER 10001" in containerfile and "VOLUME /cache" in containerfile
