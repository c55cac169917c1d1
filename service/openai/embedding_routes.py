"""POST /v1/embeddings (OpenAI's, with vLLM's extras): `input` as a string, a list of strings, a token-id list or a
list of them; `encoding_format` float or base64 (little-endian float32, as OpenAI sends it and its SDK reads it);
`dimensions` for Matryoshka models; vLLM's `truncate_prompt_tokens`, `add_special_tokens`, `normalize` and
`priority`. Served by an embedding model's server (`--runner pooling`); errors name `input[i]` or the parameter."""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Any

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.pooling import PoolingParams
from pagedserve.engine.requests import EmbeddingRequest, TextPrompt, TokensPrompt
from pagedserve.service.core.embeddings import MAX_INPUTS, Embedded, embed
from pagedserve.service.openai.generate_routes import GenerateApi
from pagedserve.service.openai.http_exchange import Exchange, answer
from pagedserve.service.openai.openai_errors import HttpError
from pagedserve.service.openai.openai_messages import flag
from pagedserve.service.openai.openai_params import POOLING_INTEGERS, check_known, integral_floats

_KNOWN = frozenset({"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens",
                    "add_special_tokens", "normalize", "priority", "request_id"})
_OPTIONS = ("dimensions", "normalize", "priority", "truncate_prompt_tokens", "adapter")


class Embeddings:
    """POST /v1/embeddings, as an ASGI app (see http_exchange.py for why)."""

    def __init__(self, api: GenerateApi):
        self.api = api

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await answer(scope, receive, send, self._answer, self.api.serving.metrics.http_done)

    async def _answer(self, exchange: Exchange) -> None:
        body, adapter = await admitted_body(self.api, exchange)
        requests = embedding_requests(body, adapter)
        reply_id = f"embd-{uuid.uuid4().hex}"
        origin = self.api.serving.telemetry.origin("openai", exchange.request_id or reply_id, exchange.scope["headers"])
        embedded = await exchange.until_disconnect(embed(self.api.serving, requests, reply_id, origin, _rename))
        self.api.serving.metrics.adapter_requests(adapter, len(embedded))
        await exchange.send_json(200, _reply(reply_id, adapter or self.api.model_name, embedded, _encoding(body)))


async def admitted_body(api: GenerateApi, exchange: Exchange) -> tuple[dict[str, Any], str | None]:
    """A pooling route's JSON object and the adapter its `model` names, once the server admits work."""
    body = await exchange.json_body(api.max_body_bytes)
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object", code="invalid_json")
    adapter = api.check_model(body)
    api.serving.state.check_admitting()
    return integral_floats(body, POOLING_INTEGERS), adapter


def embedding_requests(body: dict[str, Any], adapter: str | None) -> list[EmbeddingRequest]:
    """The body -> one engine request per input."""
    inputs = _inputs(body.get("input"))
    if _encoding(body) not in ("float", "base64"):
        raise InvalidRequestError("encoding_format", f"must be float or base64, got {body['encoding_format']!r}")
    dims, normalize = body.get("dimensions"), body.get("normalize")
    pooling = PoolingParams(normalize=normalize, dimensions=dims)
    truncate = truncate_prompt_tokens(body)
    add_special = flag(body, "add_special_tokens", True)
    priority = body.get("priority", 0)
    check_known(body, _KNOWN)
    prompts = [TextPrompt(item, add_special) if isinstance(item, str) else TokensPrompt(tuple(item))
               for item in inputs]
    return [EmbeddingRequest(p, pooling, truncate, adapter=adapter, priority=priority) for p in prompts]


def truncate_prompt_tokens(body: dict[str, Any]) -> int | None:
    """vLLM's `truncate_prompt_tokens`: an integer or absent (its range is the admission's check)."""
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and (not isinstance(truncate, int) or isinstance(truncate, bool)):
        raise InvalidRequestError("truncate_prompt_tokens", f"must be an integer, got {truncate!r}")
    return truncate


def _encoding(body: dict[str, Any]) -> Any:
    """null is the default, as in OpenAI's API."""
    value = body.get("encoding_format")
    return "float" if value is None else value


def _inputs(value: Any) -> list[str | list[int]]:
    """OpenAI's four shapes of `input`, as a list of texts or token-id lists."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("input", "must be a string, a list of strings, a list of token ids, or a list of "
                                  "token-id lists (not empty)")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [value]
    if len(value) > MAX_INPUTS:
        raise InvalidRequestError("input", f"{len(value)} inputs; at most {MAX_INPUTS} per request")
    for i, item in enumerate(value):
        tokens = isinstance(item, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in item)
        if not isinstance(item, str) and not tokens:
            raise InvalidRequestError(f"input[{i}]", "must be a string or a list of token ids")
    return value


def _rename(index: int, field: str) -> str:
    if field.split("[")[0] in _OPTIONS:
        return "model" if field == "adapter" else field
    if field.startswith("prompt_token_ids["):
        return f"input[{index}]{field.removeprefix('prompt_token_ids')}"
    return f"input[{index}]"


def _reply(reply_id: str, model: str, embedded: list[Embedded], encoding: str) -> dict[str, Any]:
    tokens = sum(e.prompt_tokens for e in embedded)
    return {"id": reply_id, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "embedding", "embedding": _encoded(e.vector, encoding)}
                     for i, e in enumerate(embedded)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector: tuple[float, ...], encoding: str) -> list[float] | str:
    if encoding == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
