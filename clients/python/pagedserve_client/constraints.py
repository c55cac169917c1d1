"""Typed structured-output options: `constraint=JsonSchema({...})`, `Regex(...)`, `Choice([...])`, `Grammar(...)`,
`JsonObject()`, `StructuralTag({...})` -> the GenerateRequest's `constraint` oneof.

Only the shape is checked here; the server compiles the spec and answers INVALID_ARGUMENT naming
`constraint.<kind>` with the grammar library's reason when it cannot.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.v1 import generate_pb2 as pb


def _json_text(value: Mapping[str, Any] | bool | str) -> str:
    return value if isinstance(value, str) else json.dumps(value)


@dataclass(frozen=True, slots=True)
class JsonSchema:
    """The output is one JSON value valid against schema (a dict, a boolean, or the schema's JSON text)."""

    schema: Mapping[str, Any] | bool | str

    def to_proto(self) -> pb.Constraint:
        return pb.Constraint(json_schema=_json_text(self.schema))


@dataclass(frozen=True, slots=True)
class JsonObject:
    """The output is any JSON object."""

    def to_proto(self) -> pb.Constraint:
        return pb.Constraint(json_object=pb.JsonObject())


@dataclass(frozen=True, slots=True)
class Regex:
    """The whole output matches pattern."""

    pattern: str

    def to_proto(self) -> pb.Constraint:
        return pb.Constraint(regex=self.pattern)


@dataclass(frozen=True, slots=True)
class Grammar:
    """The output is a sentence of a grammar: Lark (its `start` rule) or GBNF (`root ::= ...`)."""

    ebnf: str

    def to_proto(self) -> pb.Constraint:
        return pb.Constraint(grammar=self.ebnf)


@dataclass(frozen=True, slots=True)
class Choice:
    """The output is exactly one of choices."""

    choices: Sequence[str]

    def __post_init__(self) -> None:
        if isinstance(self.choices, str):  # a bare string would become its characters
            raise TypeError("Choice takes a list of strings, not one string")
        object.__setattr__(self, "choices", tuple(self.choices))

    def to_proto(self) -> pb.Constraint:
        return pb.Constraint(choice=pb.Choices(choices=list(self.choices)))


@dataclass(frozen=True, slots=True)
class StructuralTag:
    """Free text until a trigger, then a tagged JSON segment: {"structures": [{"begin", "schema", "end"}],
    "triggers": [...]} (vLLM's structural-tag format)."""

    tag: Mapping[str, Any] | str

    def to_proto(self) -> pb.Constraint:
        return pb.Constraint(structural_tag=_json_text(self.tag))


Constraint = JsonSchema | JsonObject | Regex | Grammar | Choice | StructuralTag
CONSTRAINT_TYPES = (JsonSchema, JsonObject, Regex, Grammar, Choice, StructuralTag)
