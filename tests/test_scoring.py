"""Scoring with an embedding model (engine/scoring.py, `LLM.score`): each score equals the cosine similarity of
transformers' fp32 vectors for the two texts, in vLLM's 1:1, 1:N and N:N pairings; token limits cut a text where the
model's own (Hugging Face) tokenizer ends its first N tokens; bad pairings name the side."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.scoring import ScorePairs, check_top_n, ranked, truncated_text

QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital and largest city of France.",
             "The mitochondrion is the powerhouse of the cell.",
             "Berlin is the capital of Germany.",
             "France's capital, Paris, lies on the Seine."]
TEXTS = ["Les Misérables est un roman de Victor Hugo, publié en 1862.", "def add(a, b):\n    return a + b\n",
         "naïve café ünïcode — 東京タワー 🚀 done", "   leading spaces and\ttabs\n\nnewlines"]
TOLERANCE = 1e-4  # fp32 both sides (see tests/test_embeddings.py)


@pytest.fixture(scope="module")
def embedder(default_model):
    return LLM(str(default_model.weights), dtype="float32", runner="pooling", max_num_batched_tokens=64, max_num_seqs=8)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def test_scores_are_cosines_of_transformers_vectors(embedder, hf_vector):
    expected = [cosine(hf_vector(QUERY), hf_vector(d)) for d in DOCUMENTS]
    one_to_n = embedder.score(QUERY, DOCUMENTS)
    assert max(abs(g - e) for g, e in zip(one_to_n, expected)) < TOLERANCE
    n_to_n = embedder.score([QUERY, DOCUMENTS[1], DOCUMENTS[2], QUERY], DOCUMENTS)
    pair_expected = [expected[0], cosine(hf_vector(DOCUMENTS[1]), hf_vector(DOCUMENTS[1])),
                     cosine(hf_vector(DOCUMENTS[2]), hf_vector(DOCUMENTS[2])), expected[3]]
    assert max(abs(g - e) for g, e in zip(n_to_n, pair_expected)) < TOLERANCE
    assert abs(embedder.score(DOCUMENTS[2], DOCUMENTS[2])[0] - 1.0) < TOLERANCE
    assert ranked(one_to_n) == sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    assert ranked(one_to_n, 2) == ranked(one_to_n)[:2]
    stats = embedder.engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_token_limits_cut_where_the_tokenizer_ends_token_n(embedder, hf_reference, hf_vector):
    _, tok = hf_reference
    for text in TEXTS + DOCUMENTS:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        for n in (1, 2, 5, 9):
            cut = truncated_text(embedder.tokenizer, text, n)
            assert text.startswith(cut) and len(tok.encode(cut, add_special_tokens=False)) <= n
            if n >= len(offsets):
                assert cut == text
                continue
            # transformers' tokenizer: the text up to where token n ends (or token n + 1 starts), as vLLM cuts it,
            # whenever that start re-tokenizes to at most n tokens (BPE may merge across the cut otherwise)
            first_cut = text[:min(offsets[n - 1][1], offsets[n][0])]
            if len(tok.encode(first_cut, add_special_tokens=False)) <= n:
                assert cut == first_cut, (text, n)
    cut_docs = [truncated_text(embedder.tokenizer, d, 4) for d in DOCUMENTS]
    assert cut_docs[0] == "Paris is the capital"
    got = embedder.score(QUERY, DOCUMENTS, max_tokens_per_doc=4, max_tokens_per_query=3)
    expected = [cosine(hf_vector(truncated_text(embedder.tokenizer, QUERY, 3)), hf_vector(d)) for d in cut_docs]
    assert max(abs(g - e) for g, e in zip(got, expected)) < TOLERANCE
    assert truncated_text(embedder.tokenizer, QUERY, 0) == ""


@pytest.mark.parametrize("queries, documents, field", [
    (["a", "b"], ["x", "y", "z"], "queries"),
    ([], ["x"], "queries"),
    ("a", [], "documents"),
    ("a", ["x", 3], "documents[1]"),
    ([None], ["x"], "queries[0]"),
])
def test_bad_pairings_name_the_side(queries, documents, field):
    with pytest.raises(InvalidRequestError) as info:
        ScorePairs.of(queries, documents)
    assert info.value.field == field


def test_bad_limits_are_refused(embedder):
    for kwargs, field in (({"max_tokens_per_doc": -1}, "max_tokens_per_doc"),
                          ({"max_tokens_per_query": True}, "max_tokens_per_query")):
        with pytest.raises(InvalidRequestError) as info:
            embedder.score(QUERY, DOCUMENTS, **kwargs)
        assert info.value.field == field
    for value in (-1, 1.5, False):
        with pytest.raises(InvalidRequestError):
            check_top_n(value)
