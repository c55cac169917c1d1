"""OpenAI `tools` + `tool_choice` (+ `parallel_tool_calls`) -> what the chat template renders, what constrains the
output, and how each choice's text is read back as `tool_calls`, as vLLM's OpenAI server does:

- "auto" (and `tools` without `tool_choice`) with `--enable-auto-tool-choice`: the model decides; the text is read
  by the `--tool-call-parser` format, so a plain answer stays plain. Without the flag, an explicit "auto" is refused
  naming it (vLLM's 400); `tools` without `tool_choice` is answered as "none" (vLLM refuses it too, which breaks
  every agent framework: here it answers, tools rendered, with one warning in the log).
- "required": one or more calls, forced by a grammar: in the parser's own format when one is configured (the way
  the model writes calls, read back by the same parser), else vLLM's JSON list `[{"name", "parameters"}, ...]`.
  `parallel_tool_calls: false` allows only one.
- a named function: the text is that function's arguments, forced by its parameter schema (vLLM's named mode).
- "none": plain text; tools are still rendered (vLLM's default).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.constraint import ConstraintKind
from pagedserve.engine.errors import ConfigError, InvalidRequestError
from pagedserve.service.openai.openai_constraints import RequestedConstraint, build
from pagedserve.service.openai.tool_parsers.base import NAME_PATTERN, ForcedCalls, ToolParser
from pagedserve.service.openai.tool_parsers.forced_json import JsonListFormat, NamedCallFormat, json_list_schema
from pagedserve.service.openai.tool_parsers.registry import TOOL_PARSERS
from pagedserve.service.openai.tool_parsers.stream import ToolCallStream
from pagedserve.kernels.registry import UnknownImplementationError

log = logging.getLogger(__name__)

_NO_PARAMETERS = {"type": "object", "properties": {}}
MAX_TOOLS = 128  # OpenAI's limit


@dataclass(frozen=True, slots=True)
class ToolSettings:
    """`--enable-auto-tool-choice` and `--tool-call-parser NAME` (checked at start: unknown names list the known)."""

    auto: bool = False
    parser: str | None = None

    def __post_init__(self) -> None:
        if self.auto and self.parser is None:
            raise ConfigError("enable_auto_tool_choice", "needs --tool-call-parser NAME; supported: "
                              + ", ".join(TOOL_PARSERS.names()))
        if self.parser is not None:
            try:
                TOOL_PARSERS.get(self.parser)
            except UnknownImplementationError as exc:
                raise ConfigError("tool_call_parser", str(exc)) from None

    def make_parser(self, schemas: dict[str, Any] | None = None) -> ToolParser | None:
        """The parser, bound to one request's functions when given ({name: parameters schema})."""
        if self.parser is None:
            return None
        parser = TOOL_PARSERS.get(self.parser)()
        return parser.bind(schemas) if schemas is not None else parser


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """One request's tools: what the template gets, the constraint (forced modes) and the format of the text."""

    tools: tuple[dict[str, Any], ...] | None  # for the chat template
    constraint: RequestedConstraint | None = None
    format: ToolParser | None = None  # None: the text is plain content
    named: bool = False  # a named function: OpenAI and vLLM finish with "stop", not "tool_calls"

    def stream(self) -> ToolCallStream | None:
        return ToolCallStream(self.format) if self.format is not None else None


_warned_unset = False


def tool_plan(body: dict[str, Any], settings: ToolSettings) -> ToolPlan:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice", "needs tools")
        return ToolPlan(None)
    schemas = _function_schemas(tools)
    parallel = _parallel(body)
    rendered = tuple(tools)
    if choice is None:
        if settings.auto:
            return ToolPlan(rendered, format=settings.make_parser(schemas))
        _warn_unset_once()
        return ToolPlan(rendered)
    if choice == "none":
        return ToolPlan(rendered)
    if choice == "auto":
        if not settings.auto:
            raise InvalidRequestError("tool_choice", '"auto" needs the server started with --enable-auto-tool-choice '
                                      'and --tool-call-parser NAME; set tool_choice to "required", "none" or name a '
                                      'function')
        return ToolPlan(rendered, format=settings.make_parser(schemas))
    if choice == "required":
        forced = ForcedCalls(tuple(schemas.items()), 1, None if parallel else 1)
        return ToolPlan(rendered, *_required(forced, settings, schemas))
    name = _named(choice)
    if name not in schemas:
        raise InvalidRequestError("tool_choice.function.name", f"{name!r} is not one of the tools: "
                                  + ", ".join(schemas))
    index = list(schemas).index(name)
    constraint = build(ConstraintKind.JSON_SCHEMA, schemas[name], f"tools[{index}].function.parameters")
    return ToolPlan(rendered, constraint, NamedCallFormat(name), named=True)


def rendered_tools(body: dict[str, Any]) -> ToolPlan:
    """Tools for the template only (/tokenize): checked as a chat request checks them."""
    tools = body.get("tools")
    if not tools:
        return ToolPlan(None)
    _function_schemas(tools)
    return ToolPlan(tuple(tools))


def _required(forced: ForcedCalls, settings: ToolSettings,
              schemas: dict[str, Any]) -> tuple[RequestedConstraint, ToolParser]:
    parser = settings.make_parser(schemas)
    if parser is None:
        return build(ConstraintKind.JSON_SCHEMA, json_list_schema(forced), "tools"), JsonListFormat()
    return build(ConstraintKind.GRAMMAR, parser.forced_grammar(forced), "tools"), parser


def _warn_unset_once() -> None:
    global _warned_unset
    if not _warned_unset:
        _warned_unset = True
        log.warning("a request sent tools without tool_choice and this server has no --enable-auto-tool-choice: "
                    "answered as tool_choice \"none\" (tools rendered, no calls parsed; vLLM would refuse it)")


def _parallel(body: dict[str, Any]) -> bool:
    value = body.get("parallel_tool_calls", True)
    if not isinstance(value, bool):
        raise InvalidRequestError("parallel_tool_calls", f"must be a boolean, got {value!r}")
    return value


def _function_schemas(tools: Any) -> dict[str, Any]:
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", "must be a list of {\"type\": \"function\", \"function\": {...}}")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    schemas: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f"tools[{i}]", "must be {\"type\": \"function\", \"function\": {...}}")
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise InvalidRequestError(f"tools[{i}].function.name", "must be 1-64 letters, digits, underscores, dots "
                                      f"or dashes, got {name!r}")
        if name in schemas:
            raise InvalidRequestError(f"tools[{i}].function.name", f"{name!r} is named twice")
        if not isinstance(function.get("description", ""), str):
            raise InvalidRequestError(f"tools[{i}].function.description", "must be a string")
        parameters = function.get("parameters", _NO_PARAMETERS)
        if not isinstance(parameters, (dict, bool)):
            raise InvalidRequestError(f"tools[{i}].function.parameters", "must be a JSON Schema object")
        schemas[name] = parameters
    return schemas


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str):
        raise InvalidRequestError("tool_choice", 'must be "none", "auto", "required" or '
                                  '{"type": "function", "function": {"name": ...}}')
    return function["name"]
