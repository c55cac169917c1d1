"""Hypothesis strategies for structured-output specs, shared by the fuzz suites of every surface: JSON Schemas of
the shapes services send (nested objects, arrays with bounds, enums, anyOf, formats), regexes built from the
pieces real patterns use, choices and grammars; each mostly valid, sometimes broken (bad JSON, unbalanced
patterns, unknown keywords, huge bounds), so both the compiled path and the refusals get exercised."""

from __future__ import annotations

import json

from hypothesis import strategies as st

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
_SCALARS = st.one_of(
    st.just({"type": "string"}), st.just({"type": "integer"}), st.just({"type": "number"}),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-1000, 1000), st.integers(0, 1000)),
    st.builds(lambda lo, span: {"type": "string", "minLength": lo, "maxLength": lo + span},
              st.integers(0, 5), st.integers(0, 10)),
    st.sampled_from([{"type": "string", "format": f} for f in ("date", "email", "uuid", "date-time", "ipv4")]),
    st.lists(st.one_of(st.text(max_size=6), st.integers(-5, 5)), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}),
    st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(["^[a-z]+$", "^[0-9]{3}$", "^(a|b)c*$"])),
)


def _compound(inner: st.SearchStrategy) -> st.SearchStrategy:
    objects = st.builds(
        lambda props, required_count, extra: {
            "type": "object", "properties": props, "required": sorted(props)[:required_count],
            **({"additionalProperties": False} if extra else {})},
        st.dictionaries(NAMES, inner, min_size=1, max_size=4), st.integers(0, 4), st.booleans())
    arrays = st.builds(lambda items, lo, span: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + span},
                       inner, st.integers(0, 2), st.integers(0, 3))
    any_of = st.lists(inner, min_size=2, max_size=3).map(lambda options: {"anyOf": options})
    return st.one_of(objects, arrays, any_of)


VALID_SCHEMAS = st.recursive(_SCALARS, _compound, max_leaves=8)
# What a client gets wrong: not an object, unknown types, contradictions, impossible bounds, references to nowhere.
BROKEN_SCHEMAS = st.one_of(
    st.sampled_from([[1], "object", 7, {"type": "no-such-type"}, {"$ref": "#/definitions/missing"},
                     {"type": "integer", "minimum": 5, "maximum": 1}, {"type": "array", "minItems": 10**9},
                     {"type": "string", "pattern": "("}, {"allOf": [{"type": "string"}, {"type": "integer"}]}]),
    st.dictionaries(st.text(max_size=6), st.one_of(st.integers(), st.text(max_size=6)), max_size=3))
SCHEMAS = st.one_of(VALID_SCHEMAS, VALID_SCHEMAS, VALID_SCHEMAS, BROKEN_SCHEMAS)
SCHEMA_TEXT = st.one_of(SCHEMAS.map(json.dumps), st.text(max_size=12))

_ATOMS = st.sampled_from(["a", "b", "[a-z]", "[0-9]", "\\d", "\\w", "x", " ", "\\.", "[A-F0-9]", "."])
_QUANTIFIERS = st.sampled_from(["", "", "?", "*", "+", "{2}", "{1,3}"])


def _regex_piece(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.lists(inner, min_size=1, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda parts: "(" + "|".join(parts) + ")"),
        st.tuples(inner, _QUANTIFIERS).map(lambda pair: f"({pair[0]}){pair[1]}"))


VALID_REGEXES = st.recursive(st.tuples(_ATOMS, _QUANTIFIERS).map("".join), _regex_piece, max_leaves=6)
BROKEN_REGEXES = st.one_of(st.sampled_from(["(", "[a-", "a{3,1}", "*a", "(?<=a)b", "\\", "a**"]), st.text(max_size=8))
REGEXES = st.one_of(VALID_REGEXES, VALID_REGEXES, VALID_REGEXES, BROKEN_REGEXES)

CHOICES = st.one_of(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=5),
                    st.lists(st.text(max_size=4), max_size=3), st.lists(st.just("x"), min_size=257, max_size=258))
GRAMMARS = st.one_of(
    st.sampled_from(['root ::= "yes" | "no"', 'root ::= digit+\ndigit ::= [0-9]', 'root ::= "(" root ")" | "x"',
                     'root ::= ', 'root ::= missing_rule', 'start: "a"']),
    st.text(max_size=20))
STRUCTURAL_TAGS = st.one_of(
    st.builds(lambda schema: {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f"]},
              SCHEMAS),
    st.just({"structures": [{"begin": "<g>", "schema": {}, "end": "</g>"}], "triggers": ["<f"]}),
    st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=2))
