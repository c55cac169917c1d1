"""The OpenAI HTTP API's request defaults and reply shape, with vLLM's flags: --generation-config and
--override-generation-config (sampling defaults), --max-logprobs, --default-chat-template-kwargs, --response-role,
--return-tokens-as-token-ids, --enable-force-include-usage, --enable-request-id-headers and --root-path. They become
ServerConfig fields (`openai_fields`), and ServerConfig.request_policy the one RequestPolicy the routes read."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_openai_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--generation-config", default="auto",
                   help="sampling defaults for OpenAI requests that leave them out: auto (the model folder's "
                        "generation_config.json, vLLM's default), vllm (none) or a folder holding one")
    g.add_argument("--max-logprobs", type=int, default=20, help="most logprobs / top_logprobs a request may ask "
                   "for (default 20, the engine's maximum)")
    g.add_argument("--override-generation-config", type=_json_object, metavar="JSON",
                   help='sampling defaults over the model\'s generation config, e.g. \'{"temperature": 0.5, '
                        '"max_new_tokens": 256}\' (vLLM\'s; with --generation-config vllm: these alone)')
    g.add_argument("--default-chat-template-kwargs", type=_json_object, metavar="JSON",
                   help='chat template variables every chat request starts from, e.g. \'{"enable_thinking": false}\' '
                        "(vLLM's; a request's chat_template_kwargs go over them)")
    g.add_argument("--root-path", help="the OpenAI API's path prefix behind a path-routing proxy (/llm): routes answer "
                   "with and without it (vLLM's)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name each token \"token_id:42\" instead of its text, for tokens that are no whole "
                        "UTF-8 text (vLLM's; a request's return_tokens_as_token_ids says otherwise)")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="every OpenAI HTTP reply carries an x-request-id: the client's, or one made for it, which "
                        "the request is then logged and traced under (vLLM's; without it only a client's is echoed)")
    g.add_argument("--response-role", default="assistant",
                   help="the role of a chat answer that adds a turn (vLLM's; default assistant)")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="every OpenAI stream carries its usage on each chunk and ends with it, as if it set "
                        "stream_options.include_usage and continuous_usage_stats (vLLM's)")


def openai_fields(args: argparse.Namespace) -> dict[str, Any]:
    return dict(generation_config=args.generation_config, max_logprobs=args.max_logprobs,
                force_include_usage=args.enable_force_include_usage,
                override_generation_config=args.override_generation_config or {},
                default_chat_template_kwargs=args.default_chat_template_kwargs or {},
                response_role=args.response_role, root_path=args.root_path,
                return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                request_id_headers=args.enable_request_id_headers)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value
