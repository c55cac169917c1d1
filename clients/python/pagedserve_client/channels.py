"""Channel construction (plaintext, TLS, mTLS) shared by the sync and asyncio clients."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

LB_POLICIES = ("round_robin", "pick_first")


@dataclass(frozen=True, slots=True)
class TlsOptions:
    ca_file: str | Path | None = None  # None: the system roots
    cert_file: str | Path | None = None  # client certificate, for mTLS
    key_file: str | Path | None = None
    server_name: str | None = None  # override the name checked against the server certificate

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("TlsOptions: cert_file and key_file go together (mutual TLS)")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | Path | None) -> bytes | None:
            return Path(path).read_bytes() if path is not None else None

        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file), read(self.cert_file))


def resolve_target(target: str | Sequence[str]) -> str:
    """A gRPC target string; a list of "ip:port" addresses becomes gRPC's "ipv4:a,b" / "ipv6:a,b" address list.

    Names are not allowed in a list (gRPC resolves lists without DNS): use "dns:///name:port", which yields every
    address the name has (a Kubernetes headless Service, say).
    """
    if isinstance(target, str):
        return target
    addresses = list(target)
    if not addresses:
        raise ValueError("target: the address list is empty")
    versions = {_ip_version(address) for address in addresses}
    if len(versions) != 1:
        raise ValueError(f"target: mixed IPv4 and IPv6 addresses in {addresses}; use one family per list")
    return f"ipv{versions.pop()}:{','.join(addresses)}"


def _ip_version(address: str) -> int:
    host, sep, port = address.rpartition(":")
    try:
        if not sep or not port.isdigit():
            raise ValueError
        return ipaddress.ip_address(host.strip("[]")).version
    except ValueError:
        raise ValueError(f"target: {address!r} is not ip:port ([ip]:port for IPv6); for names use "
                         "'dns:///name:port'") from None


def channel_options(
    tls: TlsOptions | None, max_message_bytes: int, keepalive_s: float | None, load_balancing: str = "round_robin"
) -> list[tuple[str, object]]:
    if load_balancing not in LB_POLICIES:
        raise ValueError(f"load_balancing must be one of {', '.join(LB_POLICIES)}, got {load_balancing!r}")
    options: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Standard service config: spread calls over every address the target resolves to.
        ("grpc.service_config", json.dumps({"loadBalancingConfig": [{load_balancing: {}}]})),
    ]
    if keepalive_s is not None:
        options += [("grpc.keepalive_time_ms", int(keepalive_s * 1000)), ("grpc.keepalive_permit_without_calls", 1)]
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def sync_channel(target: str, tls: TlsOptions | None, options: list[tuple[str, object]]) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.credentials(), options=options)


def aio_channel(target: str, tls: TlsOptions | None, options: list[tuple[str, object]]) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.credentials(), options=options)
