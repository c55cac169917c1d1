"""pagedserve.v1 Embed and Rerank: EmbedRequest -> one engine EmbeddingRequest per input, RerankRequest -> a score
call (field mapping only; the checks are the admission's and the scoring's, renamed to the request's paths), run by
the serving core (service/core/embeddings.py, service/core/scores.py)."""

from __future__ import annotations

from pagedserve.engine.errors import InvalidRequestError, field_map, renamed
from pagedserve.engine.pooling import PoolingParams
from pagedserve.engine.requests import EmbeddingRequest, TextPrompt, TokensPrompt
from pagedserve.engine.scoring import ScorePairs, ranked
from pagedserve.service.core.embeddings import MAX_INPUTS, Embedded
from pagedserve.service.core.scores import ScoreCall, Scored
from pagedserve.v1 import embed_pb2 as pb

_INPUT_FIELDS = field_map({"prompt": "text", "prompt_token_ids": "token_ids.ids"})
_REQUEST_FIELDS = ("dimensions", "normalize", "priority", "adapter", "cache_salt")
_RENAMED = {"truncate_prompt_tokens": "truncate_input_tokens"}


def embedding_requests(request: pb.EmbedRequest) -> list[EmbeddingRequest]:
    if not request.inputs:
        raise InvalidRequestError("inputs", "no inputs: send at least one text or token-id list")
    if len(request.inputs) > MAX_INPUTS:
        raise InvalidRequestError("inputs", f"{len(request.inputs)} inputs; at most {MAX_INPUTS} per call")
    pooling = PoolingParams(normalize=request.normalize if request.HasField("normalize") else None,
                            dimensions=request.dimensions if request.HasField("dimensions") else None)
    truncate = request.truncate_input_tokens if request.HasField("truncate_input_tokens") else None
    return [EmbeddingRequest(_prompt(item, index), pooling, truncate, adapter=request.adapter or None,
                             priority=request.priority) for index, item in enumerate(request.inputs)]


def _prompt(item: pb.EmbedInput, index: int) -> TextPrompt | TokensPrompt:
    kind = item.WhichOneof("input")
    if kind == "text":
        add_special = item.add_special_tokens if item.HasField("add_special_tokens") else True
        return TextPrompt(item.text, add_special)
    if kind == "token_ids":
        return TokensPrompt(tuple(item.token_ids.ids))
    raise InvalidRequestError(f"inputs[{index}]", "set text or token_ids")


def rename(index: int, field: str) -> str:
    """An admission field -> the EmbedRequest path (the call's own options keep their names)."""
    if field.split(".")[0].split("[")[0] in _REQUEST_FIELDS or field in _RENAMED:
        return _RENAMED.get(field, field)
    return f"inputs[{index}].{_INPUT_FIELDS(field)}"


def embed_response(embedded: list[Embedded]) -> pb.EmbedResponse:
    return pb.EmbedResponse(
        embeddings=[pb.Embedding(values=e.vector, prompt_tokens=e.prompt_tokens, truncated=e.truncated)
                    for e in embedded],
        prompt_tokens=sum(e.prompt_tokens for e in embedded))


def rerank_call(request: pb.RerankRequest) -> ScoreCall:
    with renamed(rerank_rename):
        return ScoreCall(ScorePairs((request.query,), tuple(request.documents)), request.max_tokens_per_query,
                         request.max_tokens_per_doc, adapter=request.adapter or None, priority=request.priority)


def rerank_rename(field: str) -> str:
    """The one query is `query`; `documents[i]` and the options keep their names."""
    return "query" if field.startswith("queries") else field


def rerank_response(scored: Scored, top_n: int) -> pb.RerankResponse:
    return pb.RerankResponse(
        results=[pb.RerankResult(index=i, relevance_score=scored.scores[i]) for i in ranked(scored.scores, top_n)],
        prompt_tokens=scored.prompt_tokens)
