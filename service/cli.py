"""`pagedserve serve ...`: the only place the engine and server configurations are assembled."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from pagedserve.engine import kv_calibration
from pagedserve.engine.build import check_backends
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import ConfigError, ModelLoadError, UnsupportedError
from pagedserve.engine.loading.model_store import model_folder
from pagedserve.kernels.cpu import isa
from pagedserve.service.compilation_flags import add_compilation_flags, compilation_fields
from pagedserve.service.config import ServerConfig
from pagedserve.service.engine_flags import GROUPED_FIELDS, add_engine_flags, parse_bytes
from pagedserve.service.cors_flags import add_cors_flags, cors_config
from pagedserve.service.lora_flags import lora_config
from pagedserve.service.openai.openai_tools import ToolSettings
from pagedserve.service.openai.tool_parsers.registry import TOOL_PARSERS
from pagedserve.service.openai_flags import add_openai_flags, openai_fields
from pagedserve.service.observability_flags import add_observability_flags, observability_config
from pagedserve.service.spec_flags import speculative_config
from pagedserve.service.structured_flags import add_structured_outputs_flag, structured_outputs_fields
from pagedserve.service.tls_flags import add_tls_flags, tls_config
from pagedserve.service.vllm_argv import vllm_argv
from pagedserve.service.vllm_flags import add_vllm_flags, check_vllm_flags

def add_server_flags(parser: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=d.host, help=f"bind address (default {d.host}; 0.0.0.0 for all)")
    g.add_argument("--port", type=int, default=d.port, help=f"gRPC port, 0 = any free one (default {d.port})")
    add_tls_flags(g)
    add_cors_flags(g)
    add_openai_flags(g)
    g.add_argument("--max-message-bytes", type=parse_bytes, default=d.max_message_bytes,
                   help="largest request accepted (larger: INVALID_ARGUMENT)")
    g.add_argument("--max-send-message-bytes", type=parse_bytes, default=d.max_send_message_bytes)
    g.add_argument("--keepalive-time", type=float, default=d.keepalive_time_s, help="seconds between pings")
    g.add_argument("--keepalive-timeout", type=float, default=d.keepalive_timeout_s)
    g.add_argument("--max-connection-age", type=float,
                   help="seconds before a connection gets GOAWAY, so client-side balancers re-resolve (default: off)")
    g.add_argument("--max-connection-age-grace", type=float, default=d.max_connection_age_grace_s,
                   help=f"seconds a GOAWAY'd connection's streams get to finish (default {d.max_connection_age_grace_s})")
    g.add_argument("--drain-delay", type=float, default=d.drain_delay_s,
                   help="seconds after SIGTERM during which health and /ready say NOT_SERVING but new requests are "
                        f"still admitted, while load balancers stop routing here (default {d.drain_delay_s})")
    g.add_argument("--shutdown-grace", type=float, default=d.shutdown_grace_s,
                   help="seconds in-flight streams get to finish once admission stops (after --drain-delay; "
                        f"default {d.shutdown_grace_s})")
    g.add_argument("--metrics-port", type=int,
                   help="HTTP port for Prometheus /metrics, /ready (503 until loaded and once shutting down) and "
                        "/live (0 = any free one; default: off)")
    g.add_argument("--http-port", type=int,
                   help="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on --host (0 = any free "
                        "port; default: off)")
    g.add_argument("--metrics-host", help="bind address for metrics (default: --host)")
    g.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="name reported by ModelInfo, in metrics and in OpenAI answers (default: the folder name); "
                        "further names are aliases OpenAI requests may use, as vLLM's")
    g.add_argument("--vllm-engine-service", action=argparse.BooleanOptionalAction, default=d.vllm_engine_service,
                   help="also serve vllm.grpc.engine.VllmEngine, the worker protocol of SMG, vllm-router and llm-d")
    g.add_argument("--ready-file", type=Path, help="write {port, metrics_port, pid} as JSON here once serving")
    g.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    g.add_argument("--api-key", help="clients must send `Authorization: Bearer KEY` (HTTP) or `authorization: "
                   "Bearer KEY` metadata (gRPC); health checks are exempt (default: no key)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines; this server never runs a checkpoint's own code, and "
                        "refuses models that need it (config.json auto_map)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='OpenAI API: tool_choice "auto" (and tools without tool_choice): the model decides, '
                        "--tool-call-parser reads its calls (vLLM's flag)")
    g.add_argument("--tool-call-parser", help="the model's tool-call format, for auto and required tool calls; one of "
                   + ", ".join(TOOL_PARSERS.names()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="pagedserve: a gRPC (and OpenAI HTTP) LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over gRPC")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL",
                       help="the model to serve, as `vllm serve MODEL` takes it (the same as --model)")
    add_engine_flags(serve)
    add_structured_outputs_flag(serve)
    add_server_flags(serve)
    serve.add_argument("--cpu-isa", default=None, metavar="TIER",
                       help=f"build the native CPU kernels for this ISA tier ({', '.join(isa.TIER_NAMES)}; default: "
                            f"native, what the CPU has); sets {isa.ENV_VAR}, which the kernels read when they build")
    add_observability_flags(serve)
    add_vllm_flags(serve)
    add_compilation_flags(serve)
    kv_calibration.add_arguments(sub.add_parser(
        "calibrate-kv", help="measure K/V ranges on text files and write FP8 k/v scales into a copy of a checkpoint"))
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name not in GROUPED_FIELDS}
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ConfigError("model", f"given twice: {tag!r} (positional) and --model {args.model!r}")
        given["model"] = tag
    given.update(structured_outputs_fields(args, given))
    given.update(compilation_fields(args, given))
    given["lora"] = lora_config(args, tuple(args.served_model_name or ()))
    given["speculative"] = speculative_config(args)
    config = EngineConfig(**{k: v for k, v in given.items() if v is not None})
    check_backends(config)  # refused here, naming the flag's field, before anything loads
    return config


def server_config(args: argparse.Namespace) -> ServerConfig:
    served_name, *aliases = _served_names(args)
    return ServerConfig(
        host=args.host, port=args.port, tls=tls_config(args), max_message_bytes=args.max_message_bytes,
        max_send_message_bytes=args.max_send_message_bytes, keepalive_time_s=args.keepalive_time,
        keepalive_timeout_s=args.keepalive_timeout, max_connection_age_s=args.max_connection_age,
        max_connection_age_grace_s=args.max_connection_age_grace, drain_delay_s=args.drain_delay,
        shutdown_grace_s=args.shutdown_grace,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, served_model_name=served_name,
        served_model_aliases=tuple(aliases),
        vllm_engine_service=args.vllm_engine_service, ready_file=args.ready_file, http_port=args.http_port,
        enable_auto_tool_choice=_tools(args).auto, tool_call_parser=args.tool_call_parser, api_key=args.api_key,
        cors=cors_config(args), observability=observability_config(args), **openai_fields(args))


def check_start(engine_cfg: EngineConfig, server_cfg: ServerConfig, trust_remote_code: bool) -> None:
    """What can be refused before anything loads: a --generation-config folder without the file, a bad
    --max-logprobs, a model that needs its own code."""
    folder = model_folder(engine_cfg.model, engine_cfg.hub)  # a hub id not in the cache stops the start here
    server_cfg.request_policy(folder)
    auto_map = _auto_map(folder / "config.json") if folder is not None and (folder / "config.json").is_file() \
        else None
    if auto_map:
        raise ConfigError("model", f"{engine_cfg.model} needs the checkpoint's own code (config.json auto_map: "
                          f"{', '.join(sorted(auto_map))}), which this server never runs"
                          + (" (--trust-remote-code cannot change that)" if trust_remote_code else ""))
    if trust_remote_code:
        logging.getLogger(__name__).info("--trust-remote-code accepted: this model needs no code of its own")


def _auto_map(config: Path) -> dict | None:
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the loader reports an unreadable config with its own error
    return data.get("auto_map") if isinstance(data, dict) and isinstance(data.get("auto_map"), dict) else None


def _served_names(args: argparse.Namespace) -> tuple[str | None, ...]:
    """--served-model-name's names (vLLM takes several: the first is reported); (None,) when not given."""
    return tuple(args.served_model_name) if args.served_model_name else (None,)


def _tools(args: argparse.Namespace) -> ToolSettings:
    """Checked here, so an unknown parser name stops the start before the model loads."""
    return ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser)


def _serve_on_two_threads(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> int:
    """gRPC and asyncio on a side thread; the engine's load and step loop on this (main) thread, where its
    OpenMP parallel regions run at full speed (engine/host/main_thread.py says why)."""
    from pagedserve.engine.host.main_thread import MainThreadHost
    from pagedserve.service.server import serve  # grpc/engine imports only after argument errors are ruled out

    host = MainThreadHost()
    outcome: dict[str, object] = {}

    def serve_in_thread() -> None:
        try:
            outcome["code"] = asyncio.run(serve(engine_cfg, server_cfg, host))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            outcome["error"] = exc
        finally:
            host.close()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, host.signal)
    server_thread = threading.Thread(target=serve_in_thread, name="pagedserve-grpc")
    server_thread.start()
    host.run()
    server_thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return int(outcome["code"])


def force_cpu_isa(tier: str | None) -> None:
    """--cpu-isa: the kernels read PAGEDSERVE_CPU_ISA at their first build, which comes after this; an unknown tier or
    one the CPU lacks fails here, before the model loads, naming the available ones."""
    if tier is None:
        return
    previous = os.environ.get(isa.ENV_VAR)
    os.environ[isa.ENV_VAR] = tier
    try:
        isa.requested_tier()
    except isa.IsaError:
        if previous is None:  # a refused tier must not stay behind for whatever builds next in this process
            del os.environ[isa.ENV_VAR]
        else:
            os.environ[isa.ENV_VAR] = previous
        raise


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(vllm_argv(parser, list(sys.argv[1:] if argv is None else argv)))
    except ConfigError as exc:  # a --config file that cannot be read, or a key that is no flag
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "calibrate-kv":
            return kv_calibration.run(args)
        force_cpu_isa(args.cpu_isa)
        engine_cfg, server_cfg = engine_config(args), server_config(args)
        check_start(engine_cfg, server_cfg, args.trust_remote_code)
        check_vllm_flags(args, engine_cfg)
        return _serve_on_two_threads(engine_cfg, server_cfg)
    except (ConfigError, ModelLoadError, UnsupportedError, isa.IsaError) as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
