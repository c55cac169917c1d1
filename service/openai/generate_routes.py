"""The generating routes of the OpenAI API: POST /v1/completions, /v1/chat/completions and /v1/responses, each an
ASGI app (see http_exchange.py for why) that parses, admits, streams or answers whole, and names errors the way its
client sent the request. Chat and completions render their own chunks (`_ChatView`); /v1/responses asks as chat and
renders as the Responses API (responses_request.py, responses_render.py)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, Protocol

from pagedserve.engine.errors import InvalidRequestError, renamed
from pagedserve.engine.reasoning import ReasoningFormat
from pagedserve.engine.requests import AdmittedRequest
from pagedserve.service.core.admit import admit_off_loop
from pagedserve.service.core.context import ServingContext
from pagedserve.service.core.request_policy import RequestPolicy
from pagedserve.service.core.stream import Ended, RequestStream
from pagedserve.service.openai.http_exchange import Exchange, answer
from pagedserve.service.openai.merged_streams import MergedStreams
from pagedserve.service.openai.openai_params import OpenAIRequest, parse
from pagedserve.service.openai.openai_responses import ResponseBuilder
from pagedserve.service.openai.openai_tools import ToolSettings
from pagedserve.service.openai.responses_render import ResponsesView
from pagedserve.service.openai.responses_request import chat_body


class GenerateApi(Protocol):
    """What the routes read of the API they serve (`openai_api.OpenAIApi` is one)."""

    serving: ServingContext
    max_body_bytes: int
    tools: ToolSettings
    policy: RequestPolicy
    model_name: str

    @property
    def reasoning(self) -> ReasoningFormat | None: ...

    def check_model(self, body: Any) -> str | None: ...

    def decode_token(self, token_id: int) -> str: ...

    def decode_ids(self, token_ids: tuple[int, ...]) -> str: ...


class Generate:
    """POST /v1/completions and /v1/chat/completions, as an ASGI app (see http_exchange.py for why)."""

    def __init__(self, api: GenerateApi, chat: bool):
        self.api, self.chat = api, chat

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await answer(scope, receive, send, self._answer, self.api.serving.metrics.http_done)

    async def _answer(self, exchange: Exchange) -> None:
        body = await exchange.json_body(self.api.max_body_bytes)
        adapter = self.api.check_model(body)
        self.api.serving.state.check_admitting()
        request, rename = self.parse(body, adapter)
        with renamed(rename):  # errors name the field as this client sent it (OpenAIRequest.param)
            admitted = await self._admit(body, request)
            self.api.serving.metrics.adapter_requests(request.adapter, len(admitted))
            with self.api.serving.state.track():
                await self._generate(exchange, request, admitted, body)

    def parse(self, body: Any, adapter: str | None) -> tuple[OpenAIRequest, Callable[[str], str]]:
        """The request, and how an engine field is named back to the client (OpenAIRequest.param)."""
        request = parse(body, self.chat, adapter, self.api.tools, self.api.policy, self.api.reasoning)
        return request, request.param

    def view(self, builder: ResponseBuilder, body: Any) -> Any:
        """What renders the outputs: chat and completions render their own chunks and responses."""
        return _ChatView(builder)

    async def _admit(self, body: Any, request: OpenAIRequest) -> tuple[AdmittedRequest, ...]:
        admit = self.api.serving.engine.admit
        return await admit_off_loop(lambda: request.admit(admit), _size(body),
                                    constrained=request.params.constraint is not None)

    async def _generate(self, exchange: Exchange, request: OpenAIRequest,
                        admitted: tuple[AdmittedRequest, ...], body: Any) -> None:
        serving = self.api.serving
        response_id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        builder = ResponseBuilder(request, admitted, response_id, request.adapter or self.api.model_name,
                                  self.api.decode_token, self.api.decode_ids)
        view = self.view(builder, body)
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
                    await self._start_stream(exchange, view)
                for chunk in view.chunks(prompt, last):
                    await _send(exchange, view, chunk)
            await self._finish(exchange, request, view)
        finally:
            await outputs.close()

    @staticmethod
    async def _start_stream(exchange: Exchange, view: Any) -> None:
        await exchange.start_sse()
        for event in view.opening():
            await _send(exchange, view, event)

    async def _finish(self, exchange: Exchange, request: OpenAIRequest, view: Any) -> None:
        if not request.stream:
            await exchange.send_json(200, view.whole())
            return
        if not exchange.started:
            await self._start_stream(exchange, view)
        for event in view.closing():
            await _send(exchange, view, event)
        await exchange.end_sse(view.done_marker)


async def _send(exchange: Exchange, view: Any, payload: dict[str, Any]) -> None:
    await exchange.sse(payload, payload["type"] if view.named_events else None)


class _ChatView:
    """Chat and completions: the builder's own chunks, the usage chunk when asked, and `data: [DONE]`."""

    done_marker, named_events = True, False

    def __init__(self, builder: ResponseBuilder):
        self.builder = builder

    def opening(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, prompt: int, output: Any) -> list[dict[str, Any]]:
        return self.builder.chunks(prompt, output)

    def closing(self) -> list[dict[str, Any]]:
        return [self.builder.usage_chunk()] if self.builder.request.include_usage else []

    def whole(self) -> dict[str, Any]:
        return self.builder.response()


class GenerateResponses(Generate):
    """POST /v1/responses: the request asked as chat (responses_request.py), answered as a response object or its
    events (responses_render.py); errors name the Responses fields."""

    def parse(self, body: Any, adapter: str | None) -> tuple[OpenAIRequest, Callable[[str], str]]:
        chat, names = chat_body(body)
        with renamed(names):
            request = parse(chat, True, adapter, self.api.tools, self.api.policy, self.api.reasoning)
        if request.params.n != 1:
            raise InvalidRequestError("n", "a response has one answer")
        return request, lambda field: names(request.param(field))

    def view(self, builder: ResponseBuilder, body: Any) -> Any:
        return ResponsesView(builder, body, self.api.decode_ids)


def _size(body: Any) -> int:
    """A cheap upper bound of the text a body carries (prompt, messages, a response's input): where to admit it
    (tokenize, render)."""
    if not isinstance(body, dict):
        return 0
    prompt = body.get("prompt")
    size = len(prompt) if isinstance(prompt, str) else 0
    if isinstance(prompt, list):
        size += sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt)
    items = body.get("input")
    size += len(items) if isinstance(items, str) else 0
    for messages in (body.get("messages"), items):
        if isinstance(messages, list):
            size += sum(len(m.get("content") or "") if isinstance(m, dict) and isinstance(m.get("content"), str)
                        else 64 for m in messages)
    return size
