"""Scoring texts against each other with an embedding model (vLLM's bi-encoder `score` and `rerank`): every query and
document is embedded on its own, as any embedding request, and a pair's score is the cosine similarity of its two
vectors (float32, as vLLM computes it), so a score does not depend on the model's normalize rule.

Queries pair with documents 1:1, 1:N (one query against every document) or N:N (query i with document i), vLLM's
three shapes. `ScorePairs` checks the shape; errors name `queries[i]` / `documents[i]`, which each front end
renames to its own field names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedserve.engine.errors import InvalidRequestError


class OffsetTokenizer(Protocol):  # what truncation reads of engine.loading.tokenizer.Tokenizer
    def encode_with_offsets(self, text: str,
                            add_special_tokens: bool = True) -> tuple[list[int], list[tuple[int, int]]]: ...


@dataclass(frozen=True, slots=True)
class ScorePairs:
    queries: tuple[str, ...]
    documents: tuple[str, ...]

    def __post_init__(self) -> None:
        for field, texts in (("queries", self.queries), ("documents", self.documents)):
            if not texts:
                raise InvalidRequestError(field, "at least one text is needed")
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise InvalidRequestError(f"{field}[{i}]", f"must be a text, got {type(text).__name__}")
        if len(self.queries) > 1 and len(self.queries) != len(self.documents):
            raise InvalidRequestError("queries", f"{len(self.queries)} queries for {len(self.documents)} documents: "
                                      "pair them 1:1, 1:N or N:N")

    @classmethod
    def of(cls, queries: str | Sequence[str], documents: str | Sequence[str]) -> ScorePairs:
        """A text or a list of texts on each side."""
        return cls(_texts(queries), _texts(documents))

    @property
    def texts(self) -> tuple[str, ...]:
        """What is embedded: the queries, then the documents (a single query once, however many documents)."""
        return self.queries + self.documents

    def field(self, index: int) -> str:
        """The name of `texts[index]`."""
        if index < len(self.queries):
            return f"queries[{index}]"
        return f"documents[{index - len(self.queries)}]"

    def truncated(self, tokenizer: OffsetTokenizer, max_tokens_per_query: int, max_tokens_per_doc: int) -> ScorePairs:
        """Each query cut to `max_tokens_per_query` tokens and each document to `max_tokens_per_doc` (0: uncut)."""
        def cut(texts: tuple[str, ...], limit: int) -> tuple[str, ...]:
            return tuple(truncated_text(tokenizer, t, limit) for t in texts) if limit else texts

        return ScorePairs(cut(self.queries, max_tokens_per_query), cut(self.documents, max_tokens_per_doc))

    def scores(self, vectors: Sequence[Sequence[float]]) -> list[float]:
        """Each document's score against its query, from the vectors of `texts` in order."""
        if len(vectors) != len(self.texts):
            raise ValueError(f"{len(vectors)} vectors for {len(self.texts)} texts")
        n = len(self.queries)
        queries = torch.tensor([list(v) for v in vectors[:n]], dtype=torch.float32)
        documents = torch.tensor([list(v) for v in vectors[n:]], dtype=torch.float32)
        if n == 1:
            queries = queries.expand_as(documents)
        return torch.nn.functional.cosine_similarity(queries, documents, dim=1).tolist()


def ranked(scores: Sequence[float], top_n: int = 0) -> list[int]:
    """Document indices, best score first (ties keep input order); `top_n` > 0 keeps that many."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return order[:top_n] if top_n else order


def check_top_n(value: object) -> int:
    return _non_negative(value, "top_n")


def truncated_text(tokenizer: OffsetTokenizer, text: str, max_tokens: int) -> str:
    """The longest start of `text` that is at most `max_tokens` tokens (special tokens not counted), cut at a token's
    character boundary as vLLM's max_tokens_per_query/max_tokens_per_doc do: a token-id cut would change how the
    model's special tokens are added, and decoding ids back may not tokenize to the same ids."""
    while True:
        ids, offsets = tokenizer.encode_with_offsets(text, add_special_tokens=False)
        if len(ids) <= max_tokens:
            return text
        if max_tokens == 0:
            return ""
        end = min(offsets[max_tokens - 1][1], offsets[max_tokens][0])
        text = text[:end] if end < len(text) else text[:-1]  # the loop ends: each pass shortens the text


def check_token_limit(value: object, field: str, max_model_len: int | None) -> int:
    """max_tokens_per_query / max_tokens_per_doc: 0 (no cut) or a count below the context length."""
    value = _non_negative(value, field)
    if max_model_len is not None and value >= max_model_len:
        raise InvalidRequestError(field, f"{value} must be less than the context length ({max_model_len})")
    return value


def _non_negative(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequestError(field, f"must be a non-negative integer, got {value!r}")
    return value


def _texts(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)
