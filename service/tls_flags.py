"""TLS flags, ours and vLLM's spellings: one certificate and key serve gRPC and HTTP; a client CA makes both mutual
TLS. vLLM's `--ssl-ca-certs` with `--ssl-cert-reqs 2` (ssl.CERT_REQUIRED) is `--tls-client-ca`; with 0
(CERT_NONE, vLLM's default) the CA is loaded by uvicorn and asks nothing of clients, so it changes nothing here
either. 1 (CERT_OPTIONAL) has no gRPC counterpart: grpc's server credentials either require a client certificate or
ask for none, so it stops the start rather than serve gRPC with a weaker rule than the flag says."""

from __future__ import annotations

import argparse
import logging
import ssl
from pathlib import Path

from pagedserve.engine.errors import ConfigError
from pagedserve.service.config import TlsConfig

logger = logging.getLogger(__name__)

_CERT_REQS = (int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED))


def _cert_reqs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value not in _CERT_REQS:
        raise argparse.ArgumentTypeError(f"{value}: one of 0 (none), 1 (optional), 2 (required), as ssl.CERT_*")
    return value


def add_tls_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--tls-cert", "--ssl-certfile", type=Path,
                       help="server certificate (PEM); enables TLS on gRPC and HTTP (--ssl-certfile: vLLM's spelling)")
    group.add_argument("--tls-key", "--ssl-keyfile", type=Path, help="server private key (PEM; also --ssl-keyfile)")
    group.add_argument("--tls-client-ca", type=Path, help="CA for client certificates; enables mutual TLS")
    group.add_argument("--ssl-ca-certs", type=Path, help="vLLM's client CA: with --ssl-cert-reqs 2, the same as "
                       "--tls-client-ca; with 0 (the default) clients are asked for nothing, as in vLLM")
    group.add_argument("--ssl-cert-reqs", type=_cert_reqs, metavar="{0,1,2}",
                       help="vLLM's client-certificate rule, as ssl.CERT_*: 0 none (default), 2 required (mutual "
                            "TLS on gRPC and HTTP); 1 (optional) is refused: gRPC cannot ask without requiring")


def tls_config(args: argparse.Namespace) -> TlsConfig | None:
    client_ca = _client_ca(args)
    if not (args.tls_cert or args.tls_key or client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise ConfigError("tls", "--tls-cert and --tls-key (vLLM's --ssl-certfile, --ssl-keyfile) are both required "
                                 "for TLS")
    return TlsConfig(args.tls_cert, args.tls_key, client_ca)


def _client_ca(args: argparse.Namespace) -> Path | None:
    """The CA client certificates must be signed by, from either spelling; None: clients present none."""
    reqs = args.ssl_cert_reqs
    if reqs == ssl.CERT_OPTIONAL:
        raise ConfigError("ssl_cert_reqs", "1 (optional client certificates) cannot be served on gRPC, whose "
                                           "credentials require one or ask for none; use 2 (required) or 0")
    if reqs == ssl.CERT_REQUIRED:
        ca = args.ssl_ca_certs or args.tls_client_ca
        if ca is None:
            raise ConfigError("ssl_cert_reqs", "2 (required) needs the CA that signs client certificates: "
                                               "--ssl-ca-certs (or --tls-client-ca)")
        if args.ssl_ca_certs and args.tls_client_ca and args.ssl_ca_certs != args.tls_client_ca:
            raise ConfigError("ssl_ca_certs", f"{args.ssl_ca_certs} disagrees with --tls-client-ca "
                                              f"{args.tls_client_ca}")
        return ca
    if reqs == ssl.CERT_NONE and args.tls_client_ca is not None:
        raise ConfigError("ssl_cert_reqs", "0 asks clients for no certificate, but --tls-client-ca requires one")
    if args.ssl_ca_certs is not None:
        if not args.ssl_ca_certs.is_file():
            raise ConfigError("ssl_ca_certs", f"file not found: {args.ssl_ca_certs}")
        logger.info("--ssl-ca-certs %s is not used: without --ssl-cert-reqs 2 clients present no certificate "
                    "(vLLM's default 0)", args.ssl_ca_certs)
    return args.tls_client_ca
