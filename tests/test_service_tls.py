"""TLS and mutual TLS with certificates generated at test time by the openssl CLI."""

from __future__ import annotations

import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from service_fixtures import start_server

from pagedserve.client import Client, ClientError, TlsOptions

_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def _openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(d: Path, name: str, usage: str) -> None:
    _openssl(d, "req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    (d / f"{name}.ext").write_text(f"subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage={usage}\n")
    _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA, a server certificate for localhost, and a client certificate, all signed by the CA."""
    d = tmp_path_factory.mktemp("certs")
    _openssl(d, "req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=pagedserve test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    _issue(d, "server", "serverAuth")
    _issue(d, "client", "clientAuth")
    return d


@pytest.fixture(scope="module")
def tls_server(certs, tmp_path_factory):
    # vLLM's spellings of --tls-cert / --tls-key (the mTLS server below uses ours)
    server = start_server(tmp_path_factory.mktemp("tls-server"), "--ssl-certfile", str(certs / "server.pem"),
                          "--ssl-keyfile", str(certs / "server.key"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mtls_server(certs, tmp_path_factory):
    # ours for the server's pair, vLLM's for the client rule (test_service_config: the same as --tls-client-ca)
    server = start_server(tmp_path_factory.mktemp("mtls-server"), "--tls-cert", str(certs / "server.pem"),
                          "--tls-key", str(certs / "server.key"), "--ssl-ca-certs", str(certs / "ca.pem"),
                          "--ssl-cert-reqs", "2", "--http-port", "0")
    yield server
    server.stop()


def _two_tokens(client: Client) -> int:
    return client.complete("Hello", max_new_tokens=2, ignore_eos=True).final.usage.completion_tokens


def test_tls_connection_generates(tls_server, certs):
    with Client(tls_server.target, tls=TlsOptions(ca_file=certs / "ca.pem"), timeout=120) as client:
        assert _two_tokens(client) == 2
        assert client.model_info().architecture == "LlamaForCausalLM"


def test_plaintext_client_cannot_talk_to_a_tls_server(tls_server):
    with Client(tls_server.target, timeout=10) as client, pytest.raises(ClientError) as info:
        client.tokenize("hi")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_mtls_connection_with_a_client_certificate_generates(mtls_server, certs):
    tls = TlsOptions(ca_file=certs / "ca.pem", cert_file=certs / "client.pem", key_file=certs / "client.key")
    with Client(mtls_server.target, tls=tls, timeout=120) as client:
        assert _two_tokens(client) == 2


def test_mtls_refuses_a_client_without_a_certificate(mtls_server, certs):
    with Client(mtls_server.target, tls=TlsOptions(ca_file=certs / "ca.pem"), timeout=10) as client:
        with pytest.raises(ClientError) as info:
            client.tokenize("hi")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_a_certificate_from_another_ca(mtls_server, certs, tmp_path):
    _openssl(tmp_path, "req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=rogue CA", "-addext", "basicConstraints=critical,CA:TRUE")
    _issue(tmp_path, "client", "clientAuth")
    tls = TlsOptions(ca_file=certs / "ca.pem", cert_file=tmp_path / "client.pem", key_file=tmp_path / "client.key")
    with Client(mtls_server.target, tls=tls, timeout=10) as client, pytest.raises(ClientError) as info:
        client.tokenize("hi")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def _https_models(server, certs: Path, client_cert: bool) -> int:
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if client_cert:
        context.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
    url = f"https://localhost:{server.http_port}/v1/models"
    return urllib.request.urlopen(url, context=context, timeout=30).status


def test_the_http_api_uses_the_same_mutual_tls(mtls_server, certs):
    assert _https_models(mtls_server, certs, client_cert=True) == 200
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionResetError)):
        _https_models(mtls_server, certs, client_cert=False)
