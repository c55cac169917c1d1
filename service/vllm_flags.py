"""Flags that `vllm serve` launch scripts and Helm charts pass and that set nothing here, so those command lines
start unchanged where the value means what this server does anyway, and stop naming the flag where it does not:

- --tensor-parallel-size / -tp, --pipeline-parallel-size / -pp, --data-parallel-size / -dp: 1 (one device per
  server; more replicas go behind the router, docs/scale-out.md);
- --enable-chunked-prefill: prefills are always chunked by --max-num-batched-tokens; --no-enable-chunked-prefill
  is refused;
- --swap-space: accepted and unused, as vLLM's V1 engine leaves it (preemption recomputes; nothing is swapped);
- --load-format: auto, safetensors or gguf, and it must match the model's files;
- --code-revision, --hf-token: accepted and unused (no checkpoint code runs; nothing is downloaded);
- --disable-fastapi-docs: there are no /docs pages here; --disable-frontend-multiprocessing: the HTTP front end
  always runs in the server's process; --enable-server-load-tracking: /load always counts the requests in flight;
- --api-server-count: 1 (one HTTP front end in the server's process); --chat-template-content-format: auto or
  string (messages reach the template with text content; text parts joined), `openai` (parts as a list) is refused;
- --enable-prompt-tokens-details: OpenAI usage always carries prompt_tokens_details.cached_tokens here;
- --uvicorn-log-level: the HTTP server's loggers' level, apart from --log-level; --disable-uvicorn-access-log: it
  never writes access lines here (--enable-log-requests logs each request).
"""

from __future__ import annotations

import argparse
import logging

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import ConfigError
from pagedserve.engine.loading.model_store import resolve_model

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf")
UVICORN_LOG_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING,
                      "info": logging.INFO, "debug": logging.DEBUG, "trace": 5}  # uvicorn's own TRACE level
_PARALLEL_SIZES = (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp"),
                   ("--data-parallel-size", "-dp"))


def _one_device(text: str) -> int:
    try:
        size = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if size != 1:
        raise argparse.ArgumentTypeError(
            f"{size}: one device per server here; serve more replicas behind the router instead (docs/scale-out.md)")
    return size


def _one_front_end(text: str) -> int:
    if text.strip() != "1":
        raise argparse.ArgumentTypeError(f"{text}: one HTTP front end per server; serve more replicas behind the "
                                         "router instead (docs/scale-out.md)")
    return 1


def _swap_space(text: str) -> float:
    try:
        gib = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of GiB: {text!r}") from None
    if not gib >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 GiB, got {text!r}")
    return gib


class _ChunkedPrefill(argparse.Action):
    """--enable-chunked-prefill is what happens anyway; the --no- form asks for what this engine never does."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if option_string is not None and option_string.startswith("--no-"):
            parser.error(f"{option_string}: prefills are always chunked by --max-num-batched-tokens here")
        setattr(namespace, self.dest, True)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("vLLM launch flags (accepted where they mean what this server does)")
    for long, short in _PARALLEL_SIZES:
        g.add_argument(long, short, type=_one_device, default=1, help="1 only: one device per server")
    g.add_argument("--enable-chunked-prefill", "--no-enable-chunked-prefill", action=_ChunkedPrefill, nargs=0,
                   default=True, help="always on (chunks of --max-num-batched-tokens); the --no- form is refused")
    g.add_argument("--swap-space", type=_swap_space, default=None, metavar="GIB",
                   help="accepted, unused: preemption recomputes, nothing is swapped (as vLLM's V1 engine)")
    g.add_argument("--config", metavar="YAML", help="flags from a YAML file of long flag names and values (vLLM's "
                   "--config); the command line wins over the file (service/vllm_argv.py)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="always on: OpenAI usage carries prompt_tokens_details.cached_tokens (prefix-cache hits)")
    g.add_argument("--uvicorn-log-level", choices=tuple(UVICORN_LOG_LEVELS),
                   help="the OpenAI HTTP server's (uvicorn's) log level, apart from --log-level")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="always: the HTTP server writes no access lines (--enable-log-requests logs each request)")
    g.add_argument("--code-revision", metavar="REV", help="accepted, unused: no checkpoint code ever runs here")
    g.add_argument("--hf-token", nargs="?", const=True, metavar="TOKEN",
                   help="accepted, unused: hub ids are read from the cache on disk, never downloaded")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="always: no /docs, /redoc or /openapi.json pages are served here")
    g.add_argument("--disable-frontend-multiprocessing", action="store_true",
                   help="always: the OpenAI HTTP API runs in the server's own process")
    g.add_argument("--enable-server-load-tracking", action="store_true",
                   help="always: GET /load answers {\"server_load\": requests in flight} (vLLM's)")
    g.add_argument("--api-server-count", type=_one_front_end, default=1, help="1 only: one HTTP front end")
    g.add_argument("--chat-template-content-format", choices=("auto", "string"), default="auto",
                   help="messages reach the chat template with text content (parts joined), vLLM's `string`; "
                        "`openai` (parts as a list) is not offered")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="the model's weight files: safetensors (an HF folder) or gguf; auto: whichever it holds")


def check_vllm_flags(args: argparse.Namespace, config: EngineConfig) -> None:
    """What needs the model's path: --load-format against its files. Logs what is accepted and unused, and sets
    --uvicorn-log-level (uvicorn's loggers propagate to the handlers --log-level set up)."""
    if args.uvicorn_log_level is not None:
        logging.getLogger("uvicorn").setLevel(UVICORN_LOG_LEVELS[args.uvicorn_log_level])
    for flag, value in (("--code-revision", args.code_revision), ("--hf-token", args.hf_token)):
        if value is not None:
            logger.info("%s accepted and unused: nothing is downloaded and no checkpoint code runs here", flag)
    if args.swap_space:
        logger.info("--swap-space %s accepted and unused: preemption recomputes (as vLLM's V1 engine)",
                    args.swap_space)
    if args.load_format == "auto":
        return
    # what the engine will load: a folder holding both serves the HF one
    weights = resolve_model(config.model, hub=config.hub).weights
    served = "gguf" if weights.suffix.lower() == ".gguf" else "safetensors"
    if served != args.load_format:
        raise ConfigError("load_format", f"--load-format {args.load_format}, but {weights} is served from its "
                          f"{served} weights")
