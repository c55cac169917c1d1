"""The OpenAI-compatible HTTP API (Starlette app): /v1/completions, /v1/chat/completions, /v1/models, /health,
Prometheus /metrics (as vLLM serves it on its API port), and vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter,
/tokenize, /detokenize and /version.

`model` picks what serves a request: the base's served name (or none) the base, an adapter's name that adapter.

It serves the serving context's engine, state and metrics (service/core/context.py), shared with the other front
ends: the same requests, limits, drain and counts.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from pagedserve.engine.admission import AdmittedRequest
from pagedserve.engine.lora.config import AdapterInfo
from pagedserve.engine.reasoning import REASONING_FORMATS, ReasoningFormat
from pagedserve.service.core.adapters import AdapterAdmin
from pagedserve.service.core.admit import admit_off_loop
from pagedserve.service.core.context import ServingContext
from pagedserve.service.core.request_policy import RequestPolicy
from pagedserve.service.core.stream import Ended, RequestStream
from pagedserve.service.openai.http_exchange import ClientGone, Exchange, read_json_body
from pagedserve.service.openai.merged_streams import MergedStreams
from pagedserve.service.openai.openai_errors import HttpError, error_reply
from pagedserve.service.openai.openai_params import OpenAIRequest, parse
from pagedserve.service.openai.openai_responses import ResponseBuilder
from pagedserve.service.openai.openai_tokenize import TokenizeApi
from pagedserve.service.openai.openai_tools import ToolSettings

log = logging.getLogger(__name__)


class OpenAIApi:
    """serving: the engine, state, metrics and model name this API shares with the other front ends."""

    def __init__(self, serving: ServingContext, max_body_bytes: int, tools: ToolSettings = ToolSettings(),
                 policy: RequestPolicy = RequestPolicy()):
        self.serving, self.max_body_bytes, self.tools, self.policy = serving, max_body_bytes, tools, policy
        self.created = int(time.time())
        self.adapters = AdapterAdmin(serving)

    def app(self) -> Starlette:
        tokens = TokenizeApi(self.serving, self.max_body_bytes)
        routes = [
            Route("/v1/completions", _Generate(self, chat=False), methods=["POST"]),
            Route("/v1/chat/completions", _Generate(self, chat=True), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/load_lora_adapter", self.load_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_adapter, methods=["POST"]),
            Route("/tokenize", tokens.tokenize, methods=["POST"]),
            Route("/detokenize", tokens.detokenize, methods=["POST"]),
            Route("/version", tokens.version, methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})

    @property
    def model_name(self) -> str:
        return self.serving.model_name

    def check_model(self, body: Any) -> str | None:
        """The adapter `model` names (None: the base); a name that is neither -> 404 naming `model`."""
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or model == self.model_name:
            return None  # a non-string model is refused by parse(), naming the field
        if self.adapters.find(model) is not None:
            return model
        count = len(self.adapters.adapters())
        adapters = f" and {count} LoRA adapter(s) (GET /v1/models lists them)" if count else ""
        raise HttpError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`{adapters}",
                        param="model", code="model_not_found")

    @property
    def reasoning(self) -> ReasoningFormat | None:
        """The engine's thought markers (--reasoning-parser), read from the loaded engine."""
        name = self.serving.engine.describe().reasoning_parser
        return REASONING_FORMATS.get(name) if name else None

    def decode_token(self, token_id: int) -> str:
        return self.decode_ids((token_id,))

    def decode_ids(self, token_ids: tuple[int, ...]) -> str:
        return self.serving.engine.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def _card(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pagedserve",
                "root": self.model_name, "parent": None}
        if self.serving.max_model_len is not None:
            card["max_model_len"] = self.serving.max_model_len
        return card

    def _adapter_card(self, adapter: AdapterInfo) -> dict[str, Any]:
        """As vLLM lists an adapter: `root` its folder, `parent` the base's served name."""
        return {"id": adapter.name, "object": "model", "created": self.created, "owned_by": "pagedserve",
                "root": adapter.path, "parent": self.model_name}

    async def models(self, request: Request) -> Response:
        cards = [self._card(), *(self._adapter_card(a) for a in self.adapters.adapters())]
        return JSONResponse({"object": "list", "data": cards})

    async def model(self, request: Request) -> Response:
        try:
            adapter = self.check_model({"model": request.path_params["model"]})
        except HttpError as exc:
            return _error(exc)
        info = self.adapters.find(adapter) if adapter is not None else None
        return JSONResponse(self._adapter_card(info) if info is not None else self._card())

    async def load_adapter(self, request: Request) -> Response:
        """vLLM's body {"lora_name", "lora_path"} and its answers: 200 with a text line, or OpenAI's error JSON."""
        try:
            body = await _admin_body(request, self.max_body_bytes)
            info = await self.adapters.load(body.get("lora_name"), body.get("lora_path"))
        except Exception as exc:  # noqa: BLE001 - every failure is an error reply, classified in one place
            return _error(exc)
        log.info("loaded LoRA adapter %s from %s", info.name, info.path)
        return PlainTextResponse(f"Success: LoRA adapter '{info.name}' added successfully.")

    async def unload_adapter(self, request: Request) -> Response:
        try:
            body = await _admin_body(request, self.max_body_bytes)
            await self.adapters.unload(body.get("lora_name"))
        except Exception as exc:  # noqa: BLE001
            return _error(exc)
        log.info("unloaded LoRA adapter %s", body["lora_name"])
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    async def metrics(self, request: Request) -> Response:
        """The same registry as --metrics-port serves (one set of counts, whichever port a scraper reads)."""
        return Response(generate_latest(self.serving.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: Request) -> Response:
        """200 while serving; 503 while the model loads or the server drains (load balancers stop sending)."""
        return Response(status_code=200 if self.serving.serving else 503)


class _Generate:
    """POST /v1/completions and /v1/chat/completions, as an ASGI app (see http_exchange.py for why)."""

    def __init__(self, api: OpenAIApi, chat: bool):
        self.api, self.chat = api, chat

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        exchange, request = Exchange(scope, receive, send), None
        try:
            exchange.check_request_id_header()
            body = await exchange.json_body(self.api.max_body_bytes)
            adapter = self.api.check_model(body)
            self.api.serving.state.check_admitting()
            request = parse(body, self.chat, adapter, self.api.tools, self.api.policy, self.api.reasoning)
            admitted = await self._admit(body, request)
            self.api.serving.metrics.adapter_requests(request.adapter, len(admitted))
            with self.api.serving.state.track():
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
            self.api.serving.metrics.http_done(scope["path"], exchange.status)

    async def _admit(self, body: Any, request: OpenAIRequest) -> tuple[AdmittedRequest, ...]:
        admit = self.api.serving.engine.admit
        return await admit_off_loop(lambda: request.admit(admit), _size(body),
                                    constrained=request.params.constraint is not None)

    async def _generate(self, exchange: Exchange, request: OpenAIRequest,
                        admitted: tuple[AdmittedRequest, ...]) -> None:
        serving = self.api.serving
        response_id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        builder = ResponseBuilder(request, admitted, response_id, request.adapter or self.api.model_name,
                                  self.api.decode_token, self.api.decode_ids)
        many = len(admitted) > 1
        origin = serving.telemetry.origin("openai", exchange.request_id or response_id, exchange.scope["headers"])
        outputs = MergedStreams([
            RequestStream(serving.engine, f"{response_id}-{i}" if many else response_id, a, serving.telemetry,
                          origin=origin).events()
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


async def _admin_body(request: Request, limit: int) -> dict[str, Any]:
    body = await read_json_body(request.receive, limit)
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _error(exc: BaseException) -> Response:
    if not isinstance(exc, HttpError) and error_reply(exc).status == 500:
        log.exception("adapter request failed")
    reply = error_reply(exc)
    return JSONResponse(reply.body, reply.status, headers=reply.headers)


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    reply = error_reply(HttpError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                  code="not_found" if exc.status_code == 404 else None))
    return JSONResponse(reply.body, reply.status)
