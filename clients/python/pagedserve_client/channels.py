"""Channel construction (plaintext, TLS, mTLS) shared by the sync and asyncio clients."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


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


def channel_options(
    tls: TlsOptions | None, max_message_bytes: int, keepalive_s: float | None
) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
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
