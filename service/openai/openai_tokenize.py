"""vLLM's /tokenize, /detokenize and /version: the prompt a request would run (text, or messages rendered by the
chat template with their tools) as token ids, ids back to text, and the server's version."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.service.core.context import ServingContext
from pagedserve.service.openai.http_exchange import read_json_body
from pagedserve.service.openai.openai_errors import HttpError, error_reply
from pagedserve.service.core.request_policy import RequestPolicy
from pagedserve.service.openai.openai_messages import chat_prompt, flag
from pagedserve.service.openai.openai_tools import rendered_tools

MAX_DETOKENIZE = 1 << 20  # token ids in one /detokenize body


class TokenizeApi:
    def __init__(self, serving: ServingContext, max_body_bytes: int, check_model: Callable[[Any], str | None],
                 policy: RequestPolicy = RequestPolicy()):
        """check_model: the OpenAI API's own check of `model` (a served name or a LoRA adapter's, as vLLM's
        /tokenize takes; adapters share the base model's tokenizer); policy: its default chat template variables
        render messages as chat requests render them."""
        self.serving, self.max_body_bytes, self.policy = serving, max_body_bytes, policy
        self.check_model = check_model

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            ids = self._ids(body)
            reply: dict[str, Any] = {"count": len(ids), "max_model_len": self.serving.max_model_len, "tokens": ids}
            if flag(body, "return_token_strs", False):
                tokenizer = self.serving.engine.tokenizer
                reply["token_strs"] = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
            return JSONResponse(reply)
        except Exception as exc:  # noqa: BLE001 - every failure is OpenAI's error JSON
            return _error(exc)

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            tokens = body.get("tokens")
            vocab = self.serving.engine.describe().vocab_size
            if not isinstance(tokens, list) or len(tokens) > MAX_DETOKENIZE or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
                raise InvalidRequestError("tokens", f"must be a list of token ids in [0, {vocab})")
            return JSONResponse({"prompt": self.serving.engine.tokenizer.decode(tokens)})
        except Exception as exc:  # noqa: BLE001
            return _error(exc)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": importlib.metadata.version("pagedserve")})

    async def _body(self, request: Request) -> dict[str, Any]:
        body = await read_json_body(request.receive, self.max_body_bytes)
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object", code="invalid_json")
        self.serving.state.check_admitting()
        self.check_model(body)
        return {k: v for k, v in body.items() if v is not None}

    def _ids(self, body: dict[str, Any]) -> list[int]:
        tokenizer = self.serving.engine.tokenizer
        if "messages" in body:
            prompt = chat_prompt(self.policy.with_template_defaults(body), rendered_tools(body))
            return tokenizer.encode(tokenizer.render_chat(prompt.messages, prompt.options), prompt.add_special_tokens)
        text = body.get("prompt")
        if not isinstance(text, str):
            raise InvalidRequestError("prompt", "must be a string (or send messages)")
        return tokenizer.encode(text, flag(body, "add_special_tokens", True))


def _error(exc: BaseException) -> Response:
    reply = error_reply(exc)
    return JSONResponse(reply.body, reply.status, headers=reply.headers)
