"""Embedding requests for every front end (OpenAI's /v1/embeddings, pagedserve.v1 Embed, the router's Embed): the
inputs of one call admitted together (one refused input refuses the call, naming it), run as one engine request
each through `RequestStream` (metrics, spans, log lines and aborts as for generations), and collected whole."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedserve.engine.errors import EngineDeadError, renamed
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.requests import AdmittedRequest, EmbeddingRequest, TextPrompt
from pagedserve.service.core.admit import admit_off_loop
from pagedserve.service.core.context import ServingContext
from pagedserve.service.core.stream import RequestStream
from pagedserve.service.core.telemetry import RequestOrigin

MAX_INPUTS = 2048  # inputs in one call (OpenAI's own limit for /v1/embeddings)


@dataclass(frozen=True, slots=True)
class Embedded:
    vector: tuple[float, ...]
    prompt_tokens: int
    truncated: bool


def admit_embeddings(serving: ServingContext, requests: Sequence[EmbeddingRequest],
                     rename: Callable[[int, str], str]) -> list[AdmittedRequest]:
    """Admits each input; an error is renamed by `rename(input index, engine field)`."""
    admitted = []
    for index, request in enumerate(requests):
        with renamed(lambda field, i=index: rename(i, field)):
            admitted.append(serving.engine.admit(request))
    return admitted


async def embed(serving: ServingContext, requests: Sequence[EmbeddingRequest], base_id: str,
                origin: RequestOrigin, rename: Callable[[int, str], str]) -> list[Embedded]:
    """The embeddings of `requests`, in order; a call carrying much text is admitted off the event loop."""
    text_chars = sum(len(r.prompt.text) for r in requests if isinstance(r.prompt, TextPrompt))
    admitted = await admit_off_loop(lambda: admit_embeddings(serving, requests, rename), text_chars)
    many = len(admitted) > 1
    try:
        with serving.state.track():
            async with asyncio.TaskGroup() as group:  # one failure cancels (aborts) the call's other inputs
                tasks = [group.create_task(_one(serving, f"{base_id}-{i}" if many else base_id, request, origin))
                         for i, request in enumerate(admitted)]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None  # classified as any single request's error is
    outputs = [task.result() for task in tasks]
    return [Embedded(out.embedding, len(request.prompt_token_ids), request.truncated)
            for out, request in zip(outputs, admitted)]


async def _one(serving: ServingContext, engine_id: str, request: AdmittedRequest,
               origin: RequestOrigin) -> RequestOutput:
    stream = RequestStream(serving.engine, engine_id, request, serving.telemetry, origin=origin)
    events = stream.events()
    try:
        async for event in events:
            if isinstance(event, RequestOutput) and event.finished and event.embedding is not None:
                return event
    finally:
        await events.aclose()  # a cancelled call (client gone) aborts the request and frees its blocks
    raise EngineDeadError("the engine stopped before the embedding was computed")
