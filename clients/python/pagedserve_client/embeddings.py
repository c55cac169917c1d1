"""Embed and Rerank (an embedding model's server: ModelInfo.runner "pooling"): inputs -> EmbedRequest, the reply ->
one `Embedding` per input, in order; a query and documents -> RerankRequest, the reply -> `Ranked` documents, best
first."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.v1 import embed_pb2, generate_pb2

EmbedInput = str | Sequence[int]  # a text, or token ids used as they are


@dataclass(frozen=True, slots=True)
class Embedding:
    values: tuple[float, ...]
    prompt_tokens: int
    truncated: bool  # truncate_input_tokens cut this input


@dataclass(frozen=True, slots=True)
class Ranked:
    index: int  # the document's place in the request
    relevance_score: float  # the cosine similarity of its embedding and the query's


def embed_request(inputs: EmbedInput | Sequence[EmbedInput], *, normalize: bool | None = None,
                  dimensions: int | None = None, truncate_input_tokens: int | None = None,
                  add_special_tokens: bool | None = None, adapter: str | None = None,
                  request_id: str | None = None, priority: int = 0) -> embed_pb2.EmbedRequest:
    """One text or token-id list, or a list of them."""
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    request = embed_pb2.EmbedRequest(adapter=adapter or "", request_id=request_id or "", priority=priority)
    for item in inputs:
        message = embed_pb2.EmbedInput(text=item) if isinstance(item, str) else \
            embed_pb2.EmbedInput(token_ids=generate_pb2.TokenIds(ids=list(item)))
        if add_special_tokens is not None:
            message.add_special_tokens = add_special_tokens
        request.inputs.append(message)
    for name, value in (("normalize", normalize), ("dimensions", dimensions),
                        ("truncate_input_tokens", truncate_input_tokens)):
        if value is not None:
            setattr(request, name, value)
    return request


def embeddings(reply: embed_pb2.EmbedResponse) -> list[Embedding]:
    return [Embedding(tuple(e.values), e.prompt_tokens, e.truncated) for e in reply.embeddings]


def rerank_request(query: str, documents: Sequence[str], *, top_n: int = 0, max_tokens_per_query: int = 0,
                   max_tokens_per_doc: int = 0, adapter: str | None = None, request_id: str | None = None,
                   priority: int = 0) -> embed_pb2.RerankRequest:
    return embed_pb2.RerankRequest(query=query, documents=list(documents), top_n=top_n,
                                   max_tokens_per_query=max_tokens_per_query, max_tokens_per_doc=max_tokens_per_doc,
                                   adapter=adapter or "", request_id=request_id or "", priority=priority)


def ranking(reply: embed_pb2.RerankResponse) -> list[Ranked]:
    return [Ranked(r.index, r.relevance_score) for r in reply.results]
