"""`pagedserve-client generate "prompt"` / `chat "message"`: stream a completion or an answer to the terminal
(also: tokenize, model-info)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from google.protobuf import json_format

from pagedserve.client.channels import TlsOptions
from pagedserve.client.constraints import Choice, Constraint, Grammar, JsonObject, JsonSchema, Regex
from pagedserve.client.errors import ClientError
from pagedserve.client.request import Message
from pagedserve.client.sync_client import Client

# Generate options exposed as flags: (flag name, type, help).
_GENERATE_FLAGS = (
    ("max-new-tokens", int, "tokens to generate (server default 16)"),
    ("min-new-tokens", int, "generate at least this many tokens"),
    ("temperature", float, "0 = greedy"),
    ("top-p", float, "nucleus sampling mass in (0, 1]"),
    ("top-k", int, "keep the k most likely tokens (0 = off)"),
    ("min-p", float, "drop tokens below min_p x the top probability"),
    ("repetition-penalty", float, ">1 discourages repeats"),
    ("presence-penalty", float, "in [-2, 2]"),
    ("frequency-penalty", float, "in [-2, 2]"),
    ("seed", int, "sampling seed"),
    ("n", int, "number of completions"),
    ("logprobs", int, "top alternatives per token"),
    ("time-limit-ms", int, "wall-clock budget for the request"),
    ("truncate-input-tokens", int, "keep only the last N prompt tokens"),
    ("adapter", str, "a LoRA adapter's name (the server's ListAdapters); default: the base model"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve-client", description=__doc__)
    parser.add_argument("--target", default="localhost:50051",
                        help="host:port, dns:///name:port or ipv4:ip:port,ip:port (calls go round-robin)")
    parser.add_argument("--timeout", type=float, help="deadline in seconds")
    parser.add_argument("--tls-ca", help="CA bundle to verify the server (enables TLS)")
    parser.add_argument("--tls-cert", help="client certificate (mTLS)")
    parser.add_argument("--tls-key", help="client key (mTLS)")
    parser.add_argument("--tls-server-name", help="expected name in the server certificate")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion")
    gen.add_argument("prompt")
    _add_generate_flags(gen)
    chat = sub.add_parser("chat", help="stream the model's answer to a user message (the model's chat template)")
    chat.add_argument("prompt", help="the user message")
    chat.add_argument("--system", help="a system message before it")
    chat.add_argument("--chat-template", help="a jinja template file to use instead of the model's")
    _add_generate_flags(chat)
    tok = sub.add_parser("tokenize", help="print token ids")
    tok.add_argument("text")
    tok.add_argument("--offsets", action="store_true")
    sub.add_parser("model-info", help="print the model, limits and live KV-cache counts as JSON")
    return parser


def _add_generate_flags(parser: argparse.ArgumentParser) -> None:
    for flag, kind, help_text in _GENERATE_FLAGS:
        parser.add_argument(f"--{flag}", type=kind, help=help_text)
    parser.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", default=None)
    parser.add_argument("--request-id", default="")
    parser.add_argument("--json", action="store_true", help="print one JSON object per completion instead of text")
    shape = parser.add_mutually_exclusive_group()  # structured output: at most one constraint
    shape.add_argument("--json-schema", help="constrain the output to this JSON Schema (JSON text, or @FILE)")
    shape.add_argument("--json-object", action="store_true", help="constrain the output to any JSON object")
    shape.add_argument("--regex", help="constrain the whole output to match this pattern")
    shape.add_argument("--grammar", help="constrain the output to this Lark or GBNF grammar (text, or @FILE)")
    shape.add_argument("--choice", action="append", help="constrain the output to one of these (repeatable)")


def _constraint(args: argparse.Namespace) -> Constraint | None:
    if args.json_schema is not None:
        return JsonSchema(_text_or_file(args.json_schema))
    if args.grammar is not None:
        return Grammar(_text_or_file(args.grammar))
    if args.regex is not None:
        return Regex(args.regex)
    if args.choice:
        return Choice(args.choice)
    return JsonObject() if args.json_object else None


def _text_or_file(value: str) -> str:
    if not value.startswith("@"):
        return value
    with open(value[1:], encoding="utf-8") as f:
        return f.read()


def _prompt(args: argparse.Namespace) -> tuple[object, dict[str, object]]:
    """generate: the text as is; chat: [system,] user messages, plus the template file's text if given."""
    if args.command == "generate":
        return args.prompt, {}
    messages = [Message("system", args.system)] if args.system else []
    messages.append(Message("user", args.prompt))
    if not args.chat_template:
        return messages, {}
    with open(args.chat_template, encoding="utf-8") as f:
        return messages, {"chat_template": f.read()}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tls = None
    if args.tls_ca or args.tls_cert:
        tls = TlsOptions(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    try:
        with Client(args.target, tls=tls, timeout=args.timeout) as client:
            if args.command in ("generate", "chat"):
                return _generate(client, args)
            if args.command == "tokenize":
                t = client.tokenize(args.text, offsets=args.offsets)
                print(json.dumps({"token_ids": list(t.token_ids), "offsets": [list(o) for o in t.offsets]}))
                return 0
            print(json_format.MessageToJson(client.model_info(), preserving_proto_field_name=True))
            return 0
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _generate(client: Client, args: argparse.Namespace) -> int:
    options = {flag.replace("-", "_"): getattr(args, flag.replace("-", "_")) for flag, _, _ in _GENERATE_FLAGS}
    options = {k: v for k, v in options.items() if v is not None}
    prompt, chat_options = _prompt(args)
    stream = client.generate(prompt, **chat_options, stop=args.stop, ignore_eos=args.ignore_eos, request_id=args.request_id,
                             constraint=_constraint(args), **options)
    try:
        for delta in stream:
            if not args.json and delta.index == 0:
                print(delta.text, end="", flush=True)
    except KeyboardInterrupt:
        stream.cancel()  # the server aborts the request and frees its KV blocks
        raise
    if args.json:
        for c in stream.results():
            final = c.final
            print(json.dumps({"index": c.index, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": final.finish_reason.value if final else None,
                              "usage": final and {"prompt_tokens": final.usage.prompt_tokens,
                                                  "completion_tokens": final.usage.completion_tokens}}))
        return 0
    final = stream.finals.get(0)
    print()
    if final is not None:
        print(f"[{final.finish_reason.value}; {final.usage.prompt_tokens} prompt + {final.usage.completion_tokens} "
              f"generated tokens; TTFT {final.timing.time_to_first_token_seconds:.3f}s; "
              f"request {stream.request_id}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
