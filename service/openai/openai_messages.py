"""OpenAI chat `messages` (and the template's other inputs) -> a `ChatPrompt`: content parts joined, assistant
`tool_calls` with their arguments as objects (as vLLM hands them to templates), `tool` results with `tool_call_id` and
`name`, `chat_template_kwargs`, `documents`, `continue_final_message`; errors name `messages[i]...`."""

from __future__ import annotations

import json
from typing import Any

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.loading.chat_template import ChatMessage, ChatOptions
from pagedserve.engine.requests import ChatPrompt, Prompt
from pagedserve.service.openai.openai_tools import ToolPlan

_TEXT_PART = "text"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # OpenAI's, and vLLM's "max"


def flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise InvalidRequestError(name, f"must be a boolean, got {value!r}")
    return value


def chat_shape(body: dict[str, Any], plan: ToolPlan) -> tuple[Prompt, str, str]:
    """vLLM's echo in chat: the answer starts with the last message's content when that message is the
    assistant's (the turn being continued)."""
    prompt = chat_prompt(body, plan)
    last = prompt.messages[-1]
    echo = (last.content or "") if flag(body, "echo", False) and last.role == "assistant" else ""
    return prompt, echo, "messages"


def chat_prompt(body: dict[str, Any], plan: ToolPlan) -> ChatPrompt:
    """messages and the template's other inputs (also for /tokenize)."""
    messages = tuple(_messages(body.get("messages")))
    kwargs = body.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs", "must be an object of template variables")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise InvalidRequestError("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}, "
                                      f"got {effort!r}")
        kwargs = {"reasoning_effort": effort, **kwargs}  # a template variable, as vLLM passes it
    documents = body.get("documents")
    if documents is not None and (not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents)):
        raise InvalidRequestError("documents", "must be a list of objects (e.g. {\"title\": ..., \"text\": ...})")
    options = ChatOptions(template=body.get("chat_template"),
                          add_generation_prompt=flag(body, "add_generation_prompt", True),
                          continue_final_message=flag(body, "continue_final_message", False),
                          tools=plan.tools, documents=tuple(documents) if documents is not None else None,
                          kwargs=tuple(kwargs.items()))
    return ChatPrompt(messages, options, flag(body, "add_special_tokens", False))


def _messages(raw: Any) -> list[ChatMessage]:
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
    return out


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

