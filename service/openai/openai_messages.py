"""An OpenAI chat body -> a `ChatPrompt`: its `messages` (read by engine/chat_messages.py, as LLM.chat reads them),
`chat_template_kwargs`, `reasoning_effort`, `documents`, `continue_final_message`; errors name the field."""

from __future__ import annotations

from typing import Any

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.chat_messages import parse_messages
from pagedserve.engine.loading.chat_template import ChatOptions
from pagedserve.engine.requests import ChatPrompt, Prompt
from pagedserve.service.openai.openai_tools import ToolPlan

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
    messages = parse_messages(body.get("messages"))
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
