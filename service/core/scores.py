"""Score and rerank calls for every front end (vLLM's /score and /rerank over HTTP, pagedserve.v1 Rerank): the call's
queries and documents cut to their token limits, embedded together through the embeddings path (one engine
request each, admitted together, one failure fails the call), and scored by cosine similarity (engine/scoring.py).
Errors name `queries[i]` / `documents[i]` or the option, through the front end's `rename`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.pooling import PoolingParams
from pagedserve.engine.requests import EmbeddingRequest, TextPrompt
from pagedserve.engine.scoring import ScorePairs, check_token_limit
from pagedserve.service.core.context import ServingContext
from pagedserve.service.core.embeddings import MAX_INPUTS, embed
from pagedserve.service.core.telemetry import RequestOrigin

_CALL_FIELDS = ("truncate_prompt_tokens", "priority", "adapter")


@dataclass(frozen=True, slots=True)
class ScoreCall:
    pairs: ScorePairs
    max_tokens_per_query: int = 0  # cut each query to this many tokens (0: uncut), as vLLM
    max_tokens_per_doc: int = 0
    truncate_prompt_tokens: int | None = None  # then keep each text's last N tokens, as an embedding request
    adapter: str | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        if len(self.pairs.texts) > MAX_INPUTS:
            raise InvalidRequestError("documents", f"{len(self.pairs.texts)} texts to embed; at most {MAX_INPUTS} "
                                      "per call")


@dataclass(frozen=True, slots=True)
class Scored:
    scores: tuple[float, ...]  # one per document, in document order
    documents: tuple[str, ...]  # as embedded (after max_tokens_per_doc)
    prompt_tokens: int  # every embedded text's tokens


async def score(serving: ServingContext, call: ScoreCall, base_id: str, origin: RequestOrigin,
                rename: Callable[[str], str]) -> Scored:
    """The scores of `call`; an error's field is `rename(queries[i] | documents[i] | option)`."""
    limit = serving.max_model_len
    try:
        pairs = call.pairs.truncated(serving.engine.tokenizer,
                                     check_token_limit(call.max_tokens_per_query, "max_tokens_per_query", limit),
                                     check_token_limit(call.max_tokens_per_doc, "max_tokens_per_doc", limit))
    except InvalidRequestError as exc:
        raise type(exc)(rename(exc.field), exc.message) from None
    requests = [EmbeddingRequest(TextPrompt(text), PoolingParams(), call.truncate_prompt_tokens, adapter=call.adapter,
                                 priority=call.priority) for text in pairs.texts]

    def text_field(index: int, field: str) -> str:
        if field.split("[")[0] in _CALL_FIELDS:
            return rename(field)
        return rename(pairs.field(index))

    embedded = await embed(serving, requests, base_id, origin, text_field)
    return Scored(tuple(pairs.scores([e.vector for e in embedded])), pairs.documents,
                  sum(e.prompt_tokens for e in embedded))
