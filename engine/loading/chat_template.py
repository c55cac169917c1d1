"""Chat messages -> the prompt text the checkpoint was trained on, rendered by its own chat template.

Rendering goes through transformers' own `render_jinja_template` (its sandboxed jinja environment with
trim_blocks/lstrip_blocks, `raise_exception`, `strftime_now`, its `tojson`, and the tokenizer's special tokens as
template variables), so the prompt is byte for byte what `tokenizer.apply_chat_template` renders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

from pagedserve.engine.errors import ConfigError, InvalidRequestError, MissingChatTemplateError

# OpenAI's message roles that carry plain content; templates decide what each one looks like.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 4096


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str | None  # None: an assistant turn that only calls tools (templates test `content` for it)
    # An assistant turn's calls, as templates read them: {"id", "type", "function": {"name", "arguments": dict}}
    tool_calls: tuple[dict[str, Any], ...] = field(default=(), hash=False)
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None  # a tool result: the function's name (some templates print it)
    # An assistant turn's thought as the client got it back (a reasoning model's templates render it in the turn
    # being answered, between tool calls); templates read it as `reasoning_content`, newer ones as `reasoning`
    reasoning: str | None = None

    def as_template_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            data["tool_calls"] = [dict(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            data["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            data["name"] = self.name
        if self.reasoning is not None:
            data["reasoning"] = data["reasoning_content"] = self.reasoning
        return data


@dataclass(frozen=True, slots=True)
class ChatOptions:
    template: str | None = None  # a jinja template for this request only; None: the model's (or --chat-template)
    add_generation_prompt: bool = True  # end with the assistant header, so the model answers
    # The last (assistant) message is left open for the model to continue; excludes add_generation_prompt.
    continue_final_message: bool = False
    # JSON values (dicts inside): left out of the hash, so hashing an options object never fails on them
    tools: tuple[dict[str, Any], ...] | None = field(default=None, hash=False)  # OpenAI tool definitions
    documents: tuple[dict[str, Any], ...] | None = field(default=None, hash=False)  # for templates that take them
    # Extra template variables (vLLM's chat_template_kwargs, e.g. enable_thinking); never override the above.
    kwargs: tuple[tuple[str, Any], ...] = field(default=(), hash=False)

    def __post_init__(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message", "cannot be set with add_generation_prompt: the "
                                      "answer either starts a new assistant turn or continues the last one")
        reserved = _RESERVED_KWARGS.intersection(name for name, _ in self.kwargs)
        if reserved:
            raise InvalidRequestError("chat_template_kwargs", f"{sorted(reserved)[0]!r} is set by the request "
                                      "itself, not through chat_template_kwargs")


# Template variables a request sets through its own fields; chat_template_kwargs may not shadow them.
_RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                              "chat_template", "conversations", "return_assistant_tokens_mask"})


def check_messages(messages: Any, field: str = "messages") -> tuple[ChatMessage, ...]:
    """A non-empty sequence of ChatMessage with known roles and string content; errors name the message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError(field, "at least one message is required")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequestError(field, f"at most {MAX_MESSAGES} messages, got {len(messages)}")
    for i, message in enumerate(messages):
        if not isinstance(message, ChatMessage):
            raise InvalidRequestError(f"{field}[{i}]", f"must be a ChatMessage, got {type(message).__name__}")
        if message.role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"{field}[{i}].role", f"unknown role {message.role!r}; supported: {', '.join(CHAT_ROLES)}")
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise InvalidRequestError(f"{field}[{i}].content", "may be null only in an assistant turn with tool_calls")
        if message.content is not None and not isinstance(message.content, str):
            raise InvalidRequestError(f"{field}[{i}].content", "must be a string")
        if message.reasoning is not None and (message.role != "assistant" or not isinstance(message.reasoning, str)):
            raise InvalidRequestError(f"{field}[{i}].reasoning", "is an assistant turn's thought, a string")
    return tuple(messages)


def read_template_file(path: str | Path) -> str:
    """`--chat-template FILE`: read and compiled once at startup, so a broken file stops the server there."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("chat_template", f"cannot read {path}: {exc}") from None
    _compile(text, lambda msg: ConfigError("chat_template", f"{path}: {msg}"))
    return text


def _compile(template: str, error: Any) -> None:
    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise error(f"template syntax error on line {exc.lineno}: {exc.message}") from None


class ChatTemplate:
    """The model's default template (or the operator's override) plus the special tokens templates read."""

    def __init__(self, hf_tokenizer: Any, model_name: str, override: str | None = None):
        self.model_name = model_name
        self.default = override if override is not None else _model_template(hf_tokenizer)
        self.tool_use = None if override is not None else _model_template(hf_tokenizer, "tool_use")
        self.special_tokens = dict(hf_tokenizer.special_tokens_map)

    @property
    def available(self) -> bool:
        return self.default is not None

    def render(self, messages: tuple[ChatMessage, ...], options: ChatOptions = ChatOptions()) -> str:
        template = self._template(options)
        chat = [m.as_template_data() for m in messages]
        tools = list(options.tools) if options.tools is not None else None
        documents = list(options.documents) if options.documents is not None else None
        variables = {**self.special_tokens, **dict(options.kwargs)}
        try:
            rendered, _ = render_jinja_template(
                conversations=[chat], chat_template=template, tools=tools, documents=documents,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, **variables)
        except jinja2.TemplateError as exc:  # raise_exception() in the template: the conversation is refused
            raise InvalidRequestError("messages", f"the chat template refused the conversation: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise InvalidRequestError("messages", f"the chat template failed on these messages: {exc}") from None
        return rendered[0]

    def _template(self, options: ChatOptions) -> str:
        if options.template is not None:
            if not isinstance(options.template, str) or not options.template:
                raise InvalidRequestError("chat_template", "must be a non-empty string")
            _compile(options.template, lambda msg: InvalidRequestError("chat_template", msg))
            return options.template
        if options.tools and self.tool_use is not None:
            return self.tool_use
        if self.default is None:
            raise MissingChatTemplateError(
                f"model {self.model_name!r} has no chat template (no chat_template.jinja and no chat_template in "
                "tokenizer_config.json); start the server with --chat-template FILE or send one with the request")
        return self.default


def _model_template(hf_tokenizer: Any, name: str = "default") -> str | None:
    """chat_template.jinja or tokenizer_config's chat_template (transformers loads either); a dict of named
    templates means its `name` entry ("tool_use" is what apply_chat_template picks with tools, when present)."""
    template = getattr(hf_tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return template.get(name) or None
    return (template or None) if name == "default" else None
