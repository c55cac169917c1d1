"""What every tool-call format provides (registry.py maps `--tool-call-parser` names to them).

A parser reads the model's whole text so far (`parse(text, final)`), never token deltas: what it returns while the
text grows is what may be sent already. Content is only what can no longer turn out to be part of a call (a
trailing piece that could start a call marker is held back); a call appears once its name and arguments are
complete. At the end (`final`), a call that does not parse (truncated by max_tokens, malformed) is given back as
content, so a client always gets a clear finish. Successive results only grow: the content of one is a prefix of
the next, and its calls are the first calls of the next, which is what streaming deltas rely on.

A parser also writes the grammar that forces calls in its own format (`tool_choice: "required"`), as a Lark grammar
for the structured-output backend (`%json` embeds each function's parameter schema), so a forced call is written
the way the model was trained to write calls and is read back by the same parser.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str
    calls: tuple[ParsedCall, ...] = ()


@dataclass(frozen=True, slots=True)
class ForcedCalls:
    """What a forced grammar must produce: one of `functions` per call, between min_calls and max_calls
    (None: no upper bound) calls."""

    functions: tuple[tuple[str, Any], ...]  # (name, parameter schema) in the order the request lists them
    min_calls: int = 1
    max_calls: int | None = None


class ToolParser(ABC):
    name: ClassVar[str]
    # The call marker is a special token of the family's tokenizer, which the text must keep to be read (vLLM's
    # mistral parser turns skip_special_tokens off for the same reason).
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str, final: bool) -> Parsed: ...

    @abstractmethod
    def forced_grammar(self, forced: ForcedCalls) -> str:
        """A Lark grammar whose every sentence parses into forced.min_calls.. calls of forced.functions."""

    def bind(self, schemas: dict[str, Any]) -> ToolParser:
        """This parser for one request's functions ({name: parameters schema}); a format whose values are typed by the
        schema (qwen3_coder's raw text) reads them with it. Most formats write JSON and need nothing."""
        return self

    def call_id(self, index: int, random_hex: str) -> str:
        """The `id` of the index-th call; most models take any string."""
        return f"chatcmpl-tool-{random_hex}"


# -- helpers the formats share ------------------------------------------------------------------------------

_DECODER = json.JSONDecoder()


def arguments_text(value: Any) -> str | None:
    """A call's arguments as OpenAI sends them (JSON text of an object), or None when they are not an object."""
    if isinstance(value, str):  # some models write the arguments as a JSON string holding the object
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def call_from_object(value: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    """{"name": ..., "arguments"|"parameters": {...}} -> a call (missing arguments: {}); anything else -> None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    present = [k for k in argument_keys if k in value]
    arguments = arguments_text(value[present[0]]) if present else "{}"
    return None if arguments is None else ParsedCall(value["name"], arguments)


def decode_json(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON value at text[start:] (after whitespace) and where it ends; None while it is incomplete/invalid."""
    start = skip_space(text, start)
    try:
        return _DECODER.raw_decode(text, start)
    except ValueError:
        return None


def skip_space(text: str, start: int) -> int:
    while start < len(text) and text[start].isspace():
        start += 1
    return start


def tagged_calls(text: str, final: bool, opening: str, closing: str,
                 read: Callable[[str], ParsedCall | None]) -> Parsed:
    """Calls written one per `opening` ... `closing` block, text around them content (Hermes' and Qwen3-Coder's
    `<tool_call>` blocks): `read` turns a block's body into a call (None: not one, and the block stays content). An
    open block waits for its end, or at the end is read as it is (Qwen may stop unclosed)."""
    content, calls, pos = [], [], 0
    while (start := text.find(opening, pos)) >= 0:
        content.append(text[pos:start])
        end = text.find(closing, start)
        if end < 0:
            if not final:
                return Parsed("".join(content), tuple(calls))
            call = read(text[start + len(opening):])
            calls += [call] if call else []
            content += [] if call else [text[start:]]
            return Parsed("".join(content), tuple(calls))
        call = read(text[start + len(opening):end])
        calls += [call] if call else []
        content += [] if call else [text[start:end + len(closing)]]
        pos = end + len(closing)
    tail = text[pos:]
    if not final:
        tail = tail[:len(tail) - held_back(tail, (opening,))]
    content.append(tail)
    return Parsed("".join(content), tuple(calls))


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of text could be the start of one of markers (not sendable yet)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def lark_literal(text: str) -> str:
    """A Lark string literal for text (JSON's escapes are Lark's)."""
    return json.dumps(text)


def lark_alternatives(rules: list[str]) -> str:
    return " | ".join(rules)


def lark_json(schema: Any) -> str:
    """A Lark rule body matching one JSON value of schema (llguidance's %json extension), without the free
    whitespace small models loop on (as the backend compiles JSON Schemas)."""
    schema = {} if schema is True else schema
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    return "%json " + json.dumps(schema)


def json_call_rules(forced: ForcedCalls, arguments_key: str) -> list[str]:
    """Lark rules `call` (one of the forced functions) and each function's `{"name": ..., "<arguments_key>": {...}}`,
    its arguments matching the function's parameters schema."""
    rules = ["call: " + " | ".join(f"call_{i}" for i in range(len(forced.functions)))]
    for i, (name, schema) in enumerate(forced.functions):
        head = json.dumps({"name": name})[:-1] + f', "{arguments_key}": '
        rules += [f"call_{i}: {lark_literal(head)} args_{i} {lark_literal('}')}", f"args_{i}: {lark_json(schema)}"]
    return rules


def repeated(item: str, separator: str, forced: ForcedCalls) -> str:
    """Lark for min_calls..max_calls items joined by separator."""
    sep = lark_literal(separator)
    required = " ".join([item] + [f"{sep} {item}"] * (forced.min_calls - 1))
    if forced.max_calls is None:
        return f"{required} ({sep} {item})*"
    optional = "".join(f" ({sep} {item}" for _ in range(forced.max_calls - forced.min_calls))
    return required + optional + ")?" * (forced.max_calls - forced.min_calls)


NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names (plus dots)
