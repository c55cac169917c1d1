"""The OpenAI-compatible HTTP API (Starlette app): /v1/completions, /v1/chat/completions, /v1/responses (their
routes: generate_routes.py), /v1/embeddings (embedding_routes.py) and vLLM's /score and /rerank (score_routes.py) on
an embedding model's server, /v1/models, /health, Prometheus /metrics (as vLLM serves it on its API port), and
vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter, /tokenize, /detokenize and /version.

`model` picks what serves a request: the base's served name (or none) the base, an adapter's name that adapter.

It serves the serving context's engine, state and metrics (service/core/context.py), shared with the other front
ends: the same requests, limits, drain and counts.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from pagedserve.engine.lora.config import AdapterInfo
from pagedserve.engine.reasoning import REASONING_FORMATS, ReasoningFormat
from pagedserve.service.core.adapters import AdapterAdmin
from pagedserve.service.core.context import ServingContext
from pagedserve.service.core.request_policy import RequestPolicy
from pagedserve.service.openai.embedding_routes import Embeddings
from pagedserve.service.openai.generate_routes import Generate, GenerateResponses
from pagedserve.service.openai.http_exchange import read_json_body
from pagedserve.service.openai.openai_errors import HttpError, error_reply
from pagedserve.service.openai.openai_params import model_field
from pagedserve.service.openai.openai_tokenize import TokenizeApi
from pagedserve.service.openai.score_routes import Scoring
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
        tokens = TokenizeApi(self.serving, self.max_body_bytes, self.check_model, self.policy)
        routes = [
            Route("/v1/completions", Generate(self, chat=False), methods=["POST"]),
            Route("/v1/chat/completions", Generate(self, chat=True), methods=["POST"]),
            Route("/v1/responses", GenerateResponses(self, chat=True), methods=["POST"]),
            Route("/v1/embeddings", Embeddings(self), methods=["POST"]),
            *(Route(path, Scoring(self, rerank=False), methods=["POST"]) for path in ("/score", "/v1/score")),
            *(Route(path, Scoring(self, rerank=True), methods=["POST"])
              for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/load", self.load, methods=["GET"]),
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
        """The adapter `model` names (None: absent or the base); a name that is neither -> 404 naming `model`, a
        non-string `model` -> 400 naming it (every route that takes `model` answers alike, as vLLM's schema does)."""
        model = model_field(body) if isinstance(body, dict) else None
        if model is None or model in self.serving.model_names:
            return None
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

    def _card(self, name: str | None = None) -> dict[str, Any]:
        """The served model's card under `name` (one of its names; default: the reported one), as vLLM lists each."""
        card = {"id": name or self.model_name, "object": "model", "created": self.created, "owned_by": "pagedserve",
                "root": self.model_name, "parent": None}
        if self.serving.max_model_len is not None:
            card["max_model_len"] = self.serving.max_model_len
        return card

    def _adapter_card(self, adapter: AdapterInfo) -> dict[str, Any]:
        """As vLLM lists an adapter: `root` its folder, `parent` the base's served name."""
        return {"id": adapter.name, "object": "model", "created": self.created, "owned_by": "pagedserve",
                "root": adapter.path, "parent": self.model_name}

    async def models(self, request: Request) -> Response:
        cards = [*(self._card(name) for name in self.serving.model_names),
                 *(self._adapter_card(a) for a in self.adapters.adapters())]
        return JSONResponse({"object": "list", "data": cards})

    async def model(self, request: Request) -> Response:
        try:
            adapter = self.check_model({"model": request.path_params["model"]})
        except HttpError as exc:
            return _error(exc)
        info = self.adapters.find(adapter) if adapter is not None else None
        name = request.path_params["model"]
        return JSONResponse(self._adapter_card(info) if info is not None else self._card(name))

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

    async def load(self, request: Request) -> Response:
        """vLLM's /load: the requests in flight now, over every front end (gRPC too), for load-aware routing."""
        return JSONResponse({"server_load": self.serving.state.in_flight})

    async def health(self, request: Request) -> Response:
        """200 while serving; 503 while the model loads or the server drains (load balancers stop sending)."""
        return Response(status_code=200 if self.serving.serving else 503)


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
