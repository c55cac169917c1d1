"""POST /score and /rerank (vLLM's, also at /v1/score, /v1/rerank and /v2/rerank, the paths Jina's and Cohere's
clients call) on an embedding model's server: each query and document embedded, a pair scored by the cosine
similarity of their vectors, as vLLM scores with an embedding model (service/core/scores.py).

/score takes `queries` + `documents` (or vLLM's other spellings: `queries` + `items`, `data_1` + `data_2`, `text_1`
+ `text_2`), each a text or a list, paired 1:1, 1:N or N:N, and answers one score per pair in order. /rerank takes
one `query` and `documents` and answers them best first, `top_n` of them (0: all). Both take vLLM's
`max_tokens_per_query`, `max_tokens_per_doc`, `truncate_prompt_tokens` and `priority`. Errors name the field as the
caller spelt it (`text_2[3]`, `query`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.errors import InvalidRequestError, renamed
from pagedserve.engine.scoring import ScorePairs, check_top_n, ranked
from pagedserve.service.core.scores import ScoreCall, Scored, score
from pagedserve.service.openai.embedding_routes import admitted_body, truncate_prompt_tokens
from pagedserve.service.openai.generate_routes import GenerateApi
from pagedserve.service.openai.http_exchange import Exchange, answer
from pagedserve.service.openai.openai_messages import flag
from pagedserve.service.openai.openai_params import check_known

SCORE_NAMES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
_OPTIONS = frozenset({"model", "user", "request_id", "priority", "truncate_prompt_tokens", "max_tokens_per_query",
                      "max_tokens_per_doc", "use_activation"})
_SCORE_KNOWN = _OPTIONS | {name for pair in SCORE_NAMES for name in pair}
_RERANK_KNOWN = _OPTIONS | {"query", "documents", "top_n", "return_documents"}


class Scoring:
    """POST /score (rerank=False) or /rerank (rerank=True), as an ASGI app (see http_exchange.py for why)."""

    def __init__(self, api: GenerateApi, rerank: bool):
        self.api, self.rerank = api, rerank

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await answer(scope, receive, send, self._answer, self.api.serving.metrics.http_done)

    async def _answer(self, exchange: Exchange) -> None:
        body, adapter = await admitted_body(self.api, exchange)
        call, rename = (rerank_call if self.rerank else score_call)(body, adapter)
        shape = RerankShape.of(body) if self.rerank else None
        reply_id = f"{'rerank' if self.rerank else 'score'}-{uuid.uuid4().hex}"
        origin = self.api.serving.telemetry.origin("openai", exchange.request_id or reply_id, exchange.scope["headers"])
        scored = await exchange.until_disconnect(score(self.api.serving, call, reply_id, origin, rename))
        self.api.serving.metrics.adapter_requests(adapter, len(call.pairs.texts))
        model = adapter or self.api.model_name
        reply = _score_reply(reply_id, model, scored) if shape is None else \
            _rerank_reply(reply_id, model, scored, call.pairs.documents, shape)
        await exchange.send_json(200, reply)


@dataclass(frozen=True, slots=True)
class RerankShape:
    top_n: int  # the best N documents (0: all)
    with_documents: bool  # each result carries its document's text (Jina's and Cohere's return_documents)

    @classmethod
    def of(cls, body: dict[str, Any]) -> RerankShape:
        top_n = body.get("top_n")
        return cls(check_top_n(0 if top_n is None else top_n), flag(body, "return_documents", True))


def score_call(body: dict[str, Any], adapter: str | None) -> tuple[ScoreCall, Callable[[str], str]]:
    """A /score body -> the call, and the renamer from `queries`/`documents` to the names it used."""
    names = next((pair for pair in SCORE_NAMES if pair[0] in body and pair[1] in body), None)
    if names is None:
        raise InvalidRequestError("queries", "send `queries` and `documents` (or text_1 and text_2, data_1 and "
                                  "data_2, queries and items)")
    check_known(body, _SCORE_KNOWN)
    rename = _renamer({"queries": names[0], "documents": names[1], "adapter": "model"})
    return _call(body, adapter, _texts(body[names[0]], names[0]), _texts(body[names[1]], names[1]), rename), rename


def rerank_call(body: dict[str, Any], adapter: str | None) -> tuple[ScoreCall, Callable[[str], str]]:
    """A /rerank body -> the call, and the renamer (the one query is `query`)."""
    query = body.get("query")
    if not isinstance(query, str):
        raise InvalidRequestError("query", f"must be a text, got {type(query).__name__}")
    if "documents" not in body:
        raise InvalidRequestError("documents", "send the documents to rank: a text or a list of texts")
    check_known(body, _RERANK_KNOWN)
    rename = _renamer({"queries": "query", "documents": "documents", "adapter": "model"})
    return _call(body, adapter, (query,), _texts(body["documents"], "documents"), rename), rename


def _call(body: dict[str, Any], adapter: str | None, queries: tuple[str, ...], documents: tuple[str, ...],
          rename: Callable[[str], str]) -> ScoreCall:
    truncate = truncate_prompt_tokens(body)
    with renamed(rename):
        return ScoreCall(ScorePairs(queries, documents), body.get("max_tokens_per_query", 0),
                         body.get("max_tokens_per_doc", 0), truncate, adapter, body.get("priority", 0))


def _texts(value: Any, field: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list):
        raise InvalidRequestError(field, "must be a text or a list of texts")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            what = "multimodal content is not supported (this model reads text)" if isinstance(item, dict) else \
                "must be a text"
            raise InvalidRequestError(f"{field}[{i}]", what)
    return tuple(value)


def _renamer(names: dict[str, str]) -> Callable[[str], str]:
    """`queries[2]` -> `text_1[2]`, `adapter` -> `model`; the one query of a rerank is `query`, without an index."""

    def rename(field: str) -> str:
        head, bracket, rest = field.partition("[")
        if head not in names:
            return field
        if names[head] == "query":
            return "query"
        return names[head] + bracket + rest

    return rename


def _score_reply(reply_id: str, model: str, scored: Scored) -> dict[str, Any]:
    return {"id": reply_id, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scored.scores)],
            "usage": {"prompt_tokens": scored.prompt_tokens, "total_tokens": scored.prompt_tokens,
                      "completion_tokens": 0}}


def _rerank_reply(reply_id: str, model: str, scored: Scored, documents: tuple[str, ...],
                  shape: RerankShape) -> dict[str, Any]:
    """Best first (vLLM's and Cohere's order); each result's `index` is the document's place in the request."""
    results = []
    for i in ranked(scored.scores, shape.top_n):
        result: dict[str, Any] = {"index": i, "relevance_score": scored.scores[i]}
        if shape.with_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {"id": reply_id, "model": model, "results": results,
            "usage": {"prompt_tokens": scored.prompt_tokens, "total_tokens": scored.prompt_tokens}}
