"""The OpenAI-compatible HTTP API (Starlette app): /v1/completions, /v1/chat/completions, /v1/models, /health.

It serves the gRPC servicer's engine, admission state and metrics: the same requests, limits, drain and counts.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagedserve.engine.admission import AdmittedRequest
from pagedserve.service.http_exchange import ClientGone, Exchange
from pagedserve.service.merged_streams import MergedStreams
from pagedserve.service.openai_errors import HttpError, error_reply
from pagedserve.service.openai_params import OpenAIRequest, parse
from pagedserve.service.openai_responses import ResponseBuilder
from pagedserve.service.servicer import GenerationServicer
from pagedserve.service.stream import Ended, RequestStream

log = logging.getLogger(__name__)
_OFF_LOOP_BYTES = 16_384  # admit (render, tokenize) larger bodies in a worker thread, off the event loop


class OpenAIApi:
    """servicer: the GenerationServicer whose engine, state, metrics and model name this API shares."""

    def __init__(self, servicer: GenerationServicer, max_body_bytes: int):
        self.servicer, self.max_body_bytes = servicer, max_body_bytes
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", _Generate(self, chat=False), methods=["POST"]),
            Route("/v1/chat/completions", _Generate(self, chat=True), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})

    @property
    def model_name(self) -> str:
        return self.servicer.model_name

    def check_model(self, body: Any) -> None:
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and model != self.model_name:
            raise HttpError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                            param="model", code="model_not_found")

    def decode_token(self, token_id: int) -> str:
        return self.servicer.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _card(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pagedserve",
                "root": self.model_name, "parent": None}
        if self.servicer.max_model_len is not None:
            card["max_model_len"] = self.servicer.max_model_len
        return card

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        try:
            self.check_model({"model": request.path_params["model"]})
        except HttpError as exc:
            reply = error_reply(exc)
            return JSONResponse(reply.body, reply.status)
        return JSONResponse(self._card())

    async def health(self, request: Request) -> Response:
        """200 while serving; 503 while the model loads or the server drains (load balancers stop sending)."""
        state = self.servicer.state
        serving = state.ready and not state.draining and self.servicer.engine.dead_reason is None
        return Response(status_code=200 if serving else 503)


class _Generate:
    """POST /v1/completions and /v1/chat/completions, as an ASGI app (see http_exchange.py for why)."""

    def __init__(self, api: OpenAIApi, chat: bool):
        self.api, self.chat = api, chat

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        exchange, request = Exchange(scope, receive, send), None
        try:
            exchange.check_request_id_header()
            body = await exchange.json_body(self.api.max_body_bytes)
            self.api.check_model(body)
            self.api.servicer.state.check_admitting()
            request = parse(body, self.chat)
            admitted = await self._admit(body, request)
            with self.api.servicer.state.track():
                await self._generate(exchange, request, admitted)
        except ClientGone:
            pass  # the engine stream was cancelled, which aborted the request and freed its blocks
        except Exception as exc:  # every failure becomes OpenAI's error JSON, never a dropped connection
            if not isinstance(exc, HttpError) and error_reply(exc).status == 500:
                log.exception("HTTP request failed")
            try:
                await exchange.send_error(error_reply(exc, request.param if request else None))
            except OSError:
                pass
        finally:
            exchange.close()
            self.api.servicer.metrics.http_done(scope["path"], exchange.status)

    async def _admit(self, body: Any, request: OpenAIRequest) -> tuple[AdmittedRequest, ...]:
        admit = self.api.servicer.engine.admit
        if _size(body) > _OFF_LOOP_BYTES:
            return await asyncio.to_thread(request.admit, admit)
        return request.admit(admit)

    async def _generate(self, exchange: Exchange, request: OpenAIRequest,
                        admitted: tuple[AdmittedRequest, ...]) -> None:
        servicer = self.api.servicer
        response_id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        builder = ResponseBuilder(request, admitted, response_id, self.api.model_name, self.api.decode_token)
        many = len(admitted) > 1
        outputs = MergedStreams([
            RequestStream(servicer.engine, f"{response_id}-{i}" if many else response_id, a, servicer.metrics).events()
            for i, a in enumerate(admitted)])
        try:
            while not builder.all_finished:
                event = await exchange.until_disconnect(outputs.next())
                if event is None:
                    break  # the engine ended the streams early (shutdown)
                prompt, last = event
                if isinstance(last, Ended):
                    continue
                if not request.stream:
                    builder.add(prompt, last)
                    continue
                if not exchange.started:  # after the first output, so admission errors still get their status
                    await exchange.start_sse()
                for chunk in builder.chunks(prompt, last):
                    await exchange.sse(chunk)
            await self._finish(exchange, request, builder)
        finally:
            await outputs.close()

    async def _finish(self, exchange: Exchange, request: OpenAIRequest, builder: ResponseBuilder) -> None:
        if not request.stream:
            await exchange.send_json(200, builder.response())
            return
        if not exchange.started:
            await exchange.start_sse()
        if request.include_usage:
            await exchange.sse(builder.usage_chunk())
        await exchange.end_sse()


def _size(body: Any) -> int:
    """A cheap upper bound of the text a body carries (prompt, messages): where to admit it (tokenize, render)."""
    if not isinstance(body, dict):
        return 0
    prompt = body.get("prompt")
    size = len(prompt) if isinstance(prompt, str) else 0
    if isinstance(prompt, list):
        size += sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt)
    messages = body.get("messages")
    if isinstance(messages, list):
        size += sum(len(m.get("content") or "") if isinstance(m, dict) and isinstance(m.get("content"), str)
                    else 64 for m in messages)
    return size


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    reply = error_reply(HttpError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                  code="not_found" if exc.status_code == 404 else None))
    return JSONResponse(reply.body, reply.status)
