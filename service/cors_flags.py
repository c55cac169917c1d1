"""vLLM's CORS flags for the OpenAI HTTP API. Each list flag takes vLLM's JSON list (`--allowed-origins
'["https://app.example.com"]'`) or plain values (`--allowed-origins https://a.example https://b.example`), so launch
lines written for either of vLLM's parsers start unchanged."""

from __future__ import annotations

import argparse
import json

from pagedserve.service.config import CorsConfig

_LISTS = (("--allowed-origins", "origins pages calling the HTTP API may come from"),
          ("--allowed-methods", "HTTP methods those pages may use"),
          ("--allowed-headers", "request headers those pages may send"))


def _values(text: str) -> list[str]:
    """One command-line word: a JSON list of strings, or a single value (a JSON object is neither: refused)."""
    if not text.lstrip().startswith(("[", "{")):
        return [text]
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} ({exc})") from None
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return values


def add_cors_flags(group: argparse._ArgumentGroup) -> None:
    for flag, what in _LISTS:
        group.add_argument(flag, type=_values, nargs="+", metavar="VALUE",
                           help=f"CORS: the {what}, as a JSON list or plain values (vLLM's; default: any, '*')")
    group.add_argument("--allow-credentials", action="store_true",
                       help="CORS: pages may send credentials (cookies, HTTP auth) (vLLM's; default: not)")


def cors_config(args: argparse.Namespace) -> CorsConfig:
    lists = {}
    for flag, _ in _LISTS:
        field = flag[2:].replace("-", "_")  # the argparse dest is also CorsConfig's field
        if getattr(args, field) is not None:
            lists[field] = tuple(value for word in getattr(args, field) for value in word)
    return CorsConfig(**lists, allow_credentials=args.allow_credentials)
