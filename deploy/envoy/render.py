"""Renders envoy.yaml.tmpl for a list of replicas: python deploy/envoy/render.py --replica HOST:PORT ... > envoy.yaml

Static endpoints suit a fixed set of replicas or a headless Service name (--dns: STRICT_DNS resolves every
address behind it); a control plane (xDS) replaces load_assignment in larger meshes.
"""

from __future__ import annotations

import argparse
import string
import sys
from pathlib import Path

TEMPLATE = Path(__file__).with_name("envoy.yaml.tmpl")


def host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def render(replicas: list[tuple[str, int]], listen: tuple[str, int], admin: tuple[str, int], *,
           dns: bool = False, stream_idle_timeout_s: int = 900, health_interval_s: float = 1.0) -> str:
    if not replicas:
        raise ValueError("at least one --replica is required")
    endpoints = "\n".join(
        f"        - endpoint: {{address: {{socket_address: {{address: \"{h}\", port_value: {p}}}}}}}"
        for h, p in replicas)
    return string.Template(TEMPLATE.read_text()).substitute(
        admin_host=admin[0], admin_port=admin[1], listen_host=listen[0], listen_port=listen[1],
        cluster_type="STRICT_DNS" if dns else "STATIC", endpoints=endpoints,
        stream_idle_timeout=f"{stream_idle_timeout_s}s", health_interval=f"{health_interval_s}s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica", type=host_port, action="append", required=True, help="HOST:PORT (repeat)")
    parser.add_argument("--listen", type=host_port, default=("0.0.0.0", 8080), help="default 0.0.0.0:8080")
    parser.add_argument("--admin", type=host_port, default=("127.0.0.1", 9901), help="default 127.0.0.1:9901")
    parser.add_argument("--dns", action="store_true", help="replicas are DNS names (STRICT_DNS)")
    parser.add_argument("--stream-idle-timeout", type=int, default=900,
                        help="seconds; above the longest queue wait + prefill (default 900)")
    parser.add_argument("--health-interval", type=float, default=1.0, help="seconds between gRPC health checks")
    parser.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    args = parser.parse_args()
    text = render(args.replica, args.listen, args.admin, dns=args.dns,
                  stream_idle_timeout_s=args.stream_idle_timeout, health_interval_s=args.health_interval)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
