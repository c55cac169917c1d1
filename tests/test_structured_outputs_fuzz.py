"""Generated regexes and JSON Schemas through the engine: each is either refused by name (`constraint.<kind>`) or
runs to a documented finish, and whatever completes matches (re.fullmatch, jsonschema); a greedy bystander in
every batch keeps its solo tokens and no block stays held. Budget: PAGEDSERVE_FUZZ_EXAMPLES (tests/fuzz_support.py).
A tiny random model: its samples wander, which is what exercises the grammars."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import make_tiny_model
from fuzz_support import fuzz_settings
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.constraint import ConstraintKind, OutputConstraint, json_schema
from pagedserve.engine.errors import InvalidRequestError

FINISHES = {"stop", "length", "constraint_dead_end"}
BYSTANDER_PROMPT = [11, 12, 13, 14]
BYSTANDER = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    llm = LLM(str(make_tiny_model(tmp_path_factory.mktemp("tiny-fuzz"), seed=5)), dtype="float32")
    alone = llm.generate([BYSTANDER_PROMPT], BYSTANDER)[0].outputs[0].token_ids
    return llm, alone


def _run(tiny, constraint: OutputConstraint, seed: int):
    """The constrained output, or None when refused by name; checks the bystander and the blocks either way."""
    llm, alone = tiny
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=48, constraint=constraint)
    try:
        shaped, bystander = llm.generate(["value:", BYSTANDER_PROMPT], [params, BYSTANDER])
    except InvalidRequestError as exc:
        assert exc.field == constraint.field, (exc.field, exc.message)
        assert not llm.engine.has_unfinished_requests()
        return None
    assert bystander.outputs[0].token_ids == alone
    stats = llm.engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert shaped.error is None and shaped.outputs[0].finish_reason in FINISHES
    return shaped.outputs[0]


_ATOMS = st.sampled_from(["a", "b", "x", "7", "[a-c]", "[0-9]", "[a-z0-9]", "-"])


def _regex_tree(inner):
    pair = st.tuples(inner, inner)
    return st.one_of(
        pair.map(lambda p: p[0] + p[1]),
        pair.map(lambda p: f"({p[0]}|{p[1]})"),
        inner.map(lambda r: f"({r})?"),
        inner.map(lambda r: f"({r})+"),
        st.tuples(inner, st.integers(0, 3), st.integers(0, 3)).map(lambda t: f"({t[0]}){{{t[1]},{t[1] + t[2]}}}"),
    )


REGEXES = st.one_of(st.recursive(_ATOMS, _regex_tree, max_leaves=6),
                    st.sampled_from(["(", "[a-", "a{3", "*a", "a{2,1}", "(?P<x", "\\", "a\\", "[0-9]\\"]))


@given(pattern=REGEXES, seed=st.integers(0, 1000))
@fuzz_settings()
def test_generated_regexes_match_or_are_refused_by_name(tiny, pattern, seed):
    try:
        OutputConstraint(ConstraintKind.REGEX, pattern)
    except InvalidRequestError as exc:
        assert exc.field == "constraint.regex"
        return
    out = _run(tiny, OutputConstraint(ConstraintKind.REGEX, pattern), seed)
    if out is not None and out.finish_reason == "stop":
        assert re.fullmatch(pattern, out.text), (pattern, out.text)


_LEAVES = st.one_of(
    st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(lambda t: {"type": "integer", "minimum": t[0],
                                                                          "maximum": t[0] + t[1]}),
    st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.just({"type": "string", "format": "date"}),
)


def _schema_tree(inner):
    props = st.dictionaries(st.sampled_from(["id", "name", "tag", "v", "sub"]), inner, min_size=1, max_size=3)
    return st.one_of(
        props.map(lambda p: {"type": "object", "properties": p, "required": sorted(p)[:1],
                             "additionalProperties": False}),
        st.tuples(inner, st.integers(0, 1), st.integers(0, 2)).map(
            lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}),
        st.lists(inner, min_size=2, max_size=2).map(lambda v: {"anyOf": v}),
    )


SCHEMAS = st.one_of(st.recursive(_LEAVES, _schema_tree, max_leaves=5),
                    st.sampled_from([{"type": "frobnicate"}, {"type": "string", "format": "no-such"},
                                     {"type": "integer", "minimum": 5, "maximum": 1}, {"$ref": "#/nowhere"}]))


@given(schema=SCHEMAS, seed=st.integers(0, 1000))
@fuzz_settings()
def test_generated_schemas_validate_or_are_refused_by_name(tiny, schema, seed):
    out = _run(tiny, json_schema(schema), seed)
    if out is not None and out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), schema)
