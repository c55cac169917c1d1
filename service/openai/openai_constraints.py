"""OpenAI's ways of asking for structured output -> at most one engine `OutputConstraint`, and the parameter it came from.

Clients say the same thing in several dialects: OpenAI's `response_format`, vLLM's `structured_outputs` extra
parameter and its older `guided_*` names, and forced tool calls (`tools` + `tool_choice`, openai_tools.py). Exactly
one may be set; two are refused naming both. Only shapes are checked here; the spec itself (a schema the grammar
library rejects, a regex it cannot compile) is checked by OutputConstraint and the admission, whose errors name
`constraint.<kind>` and are renamed to the path the client set (`OpenAIRequest.param`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.engine.constraint import (
    STRUCTURED_KINDS, ConstraintKind, OutputConstraint, StructuredOutputsParams, constraint_named,
)
from pagedserve.engine.errors import InvalidRequestError

GUIDED_PARAMS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_PARAMS = ("response_format", "structured_outputs", *GUIDED_PARAMS)

_GUIDED_KINDS = {"guided_json": ConstraintKind.JSON_SCHEMA, "guided_regex": ConstraintKind.REGEX,
                 "guided_choice": ConstraintKind.CHOICE, "guided_grammar": ConstraintKind.GRAMMAR}


@dataclass(frozen=True, slots=True)
class RequestedConstraint:
    constraint: OutputConstraint
    param: str  # the OpenAI path an error about the spec names, e.g. "response_format.json_schema.schema"


def requested_constraint(body: dict[str, Any]) -> RequestedConstraint | None:
    """The one structured-output parameter set in body (a text response_format counts as none)."""
    found = []
    if _response_format(body) is not None:
        found.append(("response_format", _from_response_format))
    if "structured_outputs" in body:
        found.append(("structured_outputs", _from_structured_outputs))
    found += [(name, _from_guided) for name in GUIDED_PARAMS if name in body]
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequestError(found[1][0], f"only one structured-output parameter per request, got {names}")
    name, build = found[0]
    return build(body, name)


def build(kind: ConstraintKind, value: Any, param: str) -> RequestedConstraint:
    """kind's constraint from a JSON value (schemas may come as objects or as JSON text); errors name param."""
    return RequestedConstraint(constraint_named(kind, value, param), param)


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidRequestError("response_format", "must be an object with a type: text, json_object, "
                                                     "json_schema or structural_tag")
    return None if fmt["type"] == "text" else fmt


def _from_response_format(body: dict[str, Any], name: str) -> RequestedConstraint:
    fmt = body[name]
    kind = fmt["type"]
    if kind == "json_object":
        return build(ConstraintKind.JSON_OBJECT, None, name)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise InvalidRequestError(f"{name}.json_schema", "must be an object with a name and a schema")
        if not isinstance(spec.get("strict", False), bool):
            raise InvalidRequestError(f"{name}.json_schema.strict", "must be a boolean")
        if "schema" not in spec:  # OpenAI allows it out; any JSON value then (vLLM does the same)
            return build(ConstraintKind.JSON_SCHEMA, {}, f"{name}.json_schema")
        return build(ConstraintKind.JSON_SCHEMA, spec["schema"], f"{name}.json_schema.schema")
    if kind == "structural_tag":  # vLLM's: the object itself, in the grammar library's format
        return build(ConstraintKind.STRUCTURAL_TAG, fmt, name)
    raise InvalidRequestError(f"{name}.type", f"unknown type {kind!r}; supported: text, json_object, json_schema, "
                                              "structural_tag")


def _from_structured_outputs(body: dict[str, Any], name: str) -> RequestedConstraint:
    spec = body[name]
    if not isinstance(spec, dict):
        raise InvalidRequestError(name, "must be an object with one of " + ", ".join(STRUCTURED_KINDS))
    unknown = sorted(set(spec) - set(STRUCTURED_KINDS))
    if unknown:
        raise InvalidRequestError(f"{name}.{unknown[0]}", "is not supported; set one of "
                                  + ", ".join(STRUCTURED_KINDS))
    params = StructuredOutputsParams(**spec)  # vLLM's offline class: the one member set, its errors named alike
    return RequestedConstraint(params.constraint(), f"{name}.{params.member}")


def _from_guided(body: dict[str, Any], name: str) -> RequestedConstraint:
    return build(_GUIDED_KINDS[name], body[name], name)
