"""What a structured-output request constrains its text to: the one engine-facing description every front end builds.

A constraint is only a description here (kind + spec, checked for shape and size). Compiling it into a grammar for
the model's tokenizer happens at admission, off the engine loop (`engine/structured_output/`), so a schema the
grammar library rejects is refused with the request, naming the field, before anything is queued.
Errors name `constraint.<kind>`; front ends rename `constraint` to their own path (`renamed(field_map(...))`).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.errors import InvalidRequestError

MAX_SPEC_BYTES = 64 * 1024  # a schema, regex or grammar; larger ones are refused before compiling
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
FIELD = "constraint"


class ConstraintKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # spec: the schema as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; spec unused ("")
    REGEX = "regex"  # spec: the pattern the whole output must match
    GRAMMAR = "grammar"  # spec: an EBNF grammar (the grammar library's dialect, docs/structured-outputs.md)
    CHOICE = "choice"  # choices: the output is exactly one of them; spec unused ("")
    STRUCTURAL_TAG = "structural_tag"  # spec: the structural tag as JSON text (the library's format)


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    kind: ConstraintKind
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ConstraintKind):
            try:
                object.__setattr__(self, "kind", ConstraintKind(self.kind))
            except ValueError:
                names = ", ".join(k.value for k in ConstraintKind)
                raise InvalidRequestError(FIELD, f"unknown constraint kind {self.kind!r}; supported: {names}") from None
        field = self.field
        if not isinstance(self.spec, str):
            raise InvalidRequestError(field, f"must be a string, got {type(self.spec).__name__}")
        if len(self.spec.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
            raise InvalidRequestError(field, f"is longer than {MAX_SPEC_BYTES} bytes")
        if self.kind in (ConstraintKind.CHOICE,):
            self._check_choices()
        elif self.choices:
            raise InvalidRequestError(field, "choices are only for the choice constraint")
        if self.kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.STRUCTURAL_TAG):
            self._check_json()
        elif self.kind in (ConstraintKind.REGEX, ConstraintKind.GRAMMAR) and not self.spec:
            raise InvalidRequestError(field, "must not be empty")

    @property
    def field(self) -> str:
        return f"{FIELD}.{self.kind.value}"

    def _check_choices(self) -> None:
        choices = self.choices
        if isinstance(choices, list):
            choices = tuple(choices)
            object.__setattr__(self, "choices", choices)
        if not isinstance(choices, tuple) or not all(isinstance(c, str) for c in choices):
            raise InvalidRequestError(self.field, "must be a list of strings")
        if not choices:
            raise InvalidRequestError(self.field, "needs at least one choice")
        if len(choices) > MAX_CHOICES:
            raise InvalidRequestError(self.field, f"at most {MAX_CHOICES} choices, got {len(choices)}")
        for i, choice in enumerate(choices):
            if not choice:
                raise InvalidRequestError(f"{self.field}[{i}]", "choices must be non-empty")
            if len(choice) > MAX_CHOICE_CHARS:
                raise InvalidRequestError(f"{self.field}[{i}]", f"choices must be <= {MAX_CHOICE_CHARS} characters")

    def _check_json(self) -> None:
        try:
            value = json.loads(self.spec)
        except ValueError as exc:
            raise InvalidRequestError(self.field, f"is not valid JSON: {exc}") from None
        if self.kind is ConstraintKind.JSON_SCHEMA and not isinstance(value, (dict, bool)):
            raise InvalidRequestError(self.field, f"a JSON Schema is an object or a boolean, got {type(value).__name__}")
        if self.kind is ConstraintKind.STRUCTURAL_TAG and not isinstance(value, dict):
            raise InvalidRequestError(self.field, f"must be a JSON object, got {type(value).__name__}")


def json_object() -> OutputConstraint:
    return OutputConstraint(ConstraintKind.JSON_OBJECT)


def json_schema(schema: dict | bool | str) -> OutputConstraint:
    return OutputConstraint(ConstraintKind.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema))


def from_oneof(message: object, kind_name: str) -> OutputConstraint:
    """A protobuf oneof whose members are named as the kinds (pagedserve.v1's `Constraint`, the router's
    SamplingParams): `choice` a message with `choices`, `json_object` a flag, every other member the spec text."""
    kind = ConstraintKind(kind_name)
    if kind is ConstraintKind.CHOICE:
        return OutputConstraint(kind, choices=tuple(getattr(message, kind_name).choices))
    if kind is ConstraintKind.JSON_OBJECT:
        return OutputConstraint(kind)
    return OutputConstraint(kind, getattr(message, kind_name))


# vLLM's StructuredOutputsParams keys -> the engine's kind (its offline class below; the OpenAI `structured_outputs`)
STRUCTURED_KINDS = {"json": ConstraintKind.JSON_SCHEMA, "regex": ConstraintKind.REGEX, "choice": ConstraintKind.CHOICE,
                    "grammar": ConstraintKind.GRAMMAR, "json_object": ConstraintKind.JSON_OBJECT,
                    "structural_tag": ConstraintKind.STRUCTURAL_TAG}


def field_under(field: str, param: str) -> str:
    """An error's field as the client named the constraint: `constraint.<kind>[i]` -> param[i]; others unchanged."""
    if field != FIELD and not field.startswith(FIELD + "."):
        return field
    rest = field[len(FIELD):].lstrip(".")
    cut = rest.find("[")
    return param + (rest[cut:] if cut >= 0 else "")


def constraint_named(kind: ConstraintKind, value: Any, param: str) -> OutputConstraint:
    """constraint_of, its errors naming `param` (the path the client set it under)."""
    try:
        return constraint_of(kind, value)
    except InvalidRequestError as exc:
        raise InvalidRequestError(field_under(exc.field, param), exc.message) from None


def constraint_of(kind: ConstraintKind, value: Any) -> OutputConstraint:
    """kind's constraint from a JSON value: a schema or structural tag as an object or JSON text, choices as a list,
    json_object from any value; errors name `constraint.<kind>`."""
    field = f"{FIELD}.{kind.value}"
    if kind is ConstraintKind.CHOICE:
        if not isinstance(value, (list, tuple)):
            raise InvalidRequestError(field, f"must be a list of strings, got {type(value).__name__}")
        return OutputConstraint(kind, choices=tuple(value))
    if kind is ConstraintKind.JSON_OBJECT:
        return OutputConstraint(kind)
    if kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.STRUCTURAL_TAG) and not isinstance(value, str):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise InvalidRequestError(field, f"must be a string, got {type(value).__name__}")
    return OutputConstraint(kind, value)


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """vLLM's offline spelling, `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`: exactly
    one of its members set; `SamplingParams` turns it into its `constraint`."""

    json: Any = None  # a JSON Schema, as a dict or JSON text
    regex: str | None = None
    choice: Any = None  # a list of strings
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    @property
    def member(self) -> str:
        """The one member set (None and False are unset); errors name structured_outputs."""
        set_ = [key for key in STRUCTURED_KINDS if getattr(self, key) is not None and getattr(self, key) is not False]
        if len(set_) != 1:
            raise InvalidRequestError("structured_outputs", f"set exactly one of {', '.join(STRUCTURED_KINDS)}, got "
                                                            f"{', '.join(set_) or 'none'}")
        return set_[0]

    def constraint(self) -> OutputConstraint:
        key = self.member
        return constraint_named(STRUCTURED_KINDS[key], getattr(self, key), f"structured_outputs.{key}")
