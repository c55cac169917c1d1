"""OpenAI-format chat messages -> the `ChatMessage`s a chat template reads, for the OpenAI front end and the offline
`LLM.chat` alike: content parts joined (text only), assistant `tool_calls` with their arguments as objects (as vLLM
hands them to templates), `tool` results with `tool_call_id` and `name`, an assistant's `reasoning` sent back."""

from __future__ import annotations

import json
from typing import Any

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.loading.chat_template import ChatMessage

_TEXT_PART = "text"


def parse_messages(raw: Any) -> tuple[ChatMessage, ...]:
    """OpenAI-format messages as the chat template reads them; errors name `messages[i]...`."""
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError("messages", "must be a non-empty list of messages")
    out = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}]", "must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidRequestError(f"messages[{i}].role", f"must be a string, got {role!r}")
        calls = _tool_calls(message.get("tool_calls"), f"messages[{i}].tool_calls") if role == "assistant" else ()
        content = message.get("content")
        content = None if content is None and calls else _content(content, f"messages[{i}].content")
        out.append(ChatMessage(role, content, calls, _optional_str(message, "tool_call_id", f"messages[{i}]"),
                               _optional_str(message, "name", f"messages[{i}]"),
                               _reasoning(message, i) if role == "assistant" else None))
    return tuple(out)


def _reasoning(message: dict[str, Any], index: int) -> str | None:
    """An assistant turn's thought sent back: vLLM's `reasoning`, or `reasoning_content` (its older name, and
    DeepSeek's API's); the template decides whether to render it."""
    for name in ("reasoning", "reasoning_content"):
        if message.get(name) is not None:
            return _optional_str(message, name, f"messages[{index}]")
    return None


def _tool_calls(raw: Any, field: str) -> tuple[dict[str, Any], ...]:
    """An assistant turn's calls as templates read them: arguments as an object (vLLM parses them for the
    template too; templates write them with tojson)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise InvalidRequestError(field, "must be a list of tool calls")
    calls = []
    for j, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"{field}[{j}]", "must be {\"id\", \"type\": \"function\", \"function\": "
                                      "{\"name\", \"arguments\"}}")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise InvalidRequestError(f"{field}[{j}].function.arguments", "must be JSON text of an object") from None
        if not isinstance(arguments, dict):
            raise InvalidRequestError(f"{field}[{j}].function.arguments", "must be JSON text of an object")
        calls.append({"id": str(call.get("id", "")), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return tuple(calls)


def _optional_str(message: dict[str, Any], name: str, field: str) -> str | None:
    value = message.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"{field}.{name}", f"must be a string, got {value!r}")
    return value


def _content(content: Any, field: str) -> str:
    """A string, or text content parts joined by newlines (as vLLM joins them); null content is empty."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequestError(field, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != _TEXT_PART or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{field}[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) "
                                      "are supported")
        texts.append(part["text"])
    return "\n".join(texts)

