"""OpenAI's Responses API request (POST /v1/responses) -> the chat completions body that asks the same, and the way
back from a chat parameter's name to the Responses field a client set.

The Responses API is served by the chat path (validation, limits, tools, structured outputs, reasoning), so its
answers and errors are the chat path's: `instructions` becomes the system turn, `input` items the messages
(`function_call` items the assistant's tool calls, `function_call_output` items tool turns, `reasoning` items the
next assistant turn's thought), flat function tools the chat shape, `text.format` the response format,
`max_output_tokens` the token limit. Nothing is stored, as on vLLM without its response store: `store` is accepted
and keeps nothing, and what would need a stored response or a hosted tool (`previous_response_id`, `conversation`,
`background`, `prompt`, item references, tools other than functions, images and files) is refused naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.errors import InvalidRequestError

# Passed to the chat body unchanged: OpenAI's own, and the vLLM extras its Responses server takes too.
_SAME = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user", "metadata", "store",
         "service_tier", "safety_identifier", "prompt_cache_key",
         "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
         "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "bad_words", "skip_special_tokens", "priority",
         "cache_salt", "request_id", "chat_template", "chat_template_kwargs", "structured_outputs",
         "thinking_token_budget", "include_reasoning")
_REFUSED = {
    "previous_response_id": "needs a stored response, and this server stores none: send the whole conversation as "
                            "input",
    "conversation": "needs stored conversations, and this server stores none: send the whole conversation as input",
    "background": "background responses need a response store, which this server does not keep",
    "prompt": "reusable prompt templates are not supported; send instructions and input",
    "top_logprobs": "is not supported on /v1/responses; chat completions' top_logprobs gives them",
}
# Responses fields this module turns into chat ones, or that mean something else in chat (never passed on under
# their own names): the Responses API's stream_options only toggles obfuscation padding, which is not sent here.
_HANDLED = frozenset({"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "reasoning",
                      "truncation", "messages", "stream_options", *_REFUSED})
# Chat parameter -> Responses field, for errors.
_NAMES = {"max_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort", "messages": "input",
          "truncate_prompt_tokens": "truncation"}
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(slots=True)
class ResponsesNames:
    """Chat parameter paths -> the Responses fields they came from: `messages[i]` is input item k (or instructions)."""

    message_paths: list[str] = field(default_factory=list)

    def __call__(self, chat_param: str) -> str:
        for prefix, responses in (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                                  ("tool_choice.function", "tool_choice")):
            if chat_param.startswith(prefix):
                return responses + chat_param[len(prefix):]
        if chat_param.startswith("tools[") and ".function" in chat_param:
            return chat_param.replace(".function", "", 1)
        if chat_param.startswith("messages["):
            index, _, rest = chat_param[len("messages["):].partition("]")
            if index.isdigit() and int(index) < len(self.message_paths):
                return self.message_paths[int(index)] + rest
        return _NAMES.get(chat_param, chat_param)


def chat_body(body: Any) -> tuple[dict[str, Any], ResponsesNames]:
    """The chat completions body for a Responses request, and the renamer its errors go through."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", f"must be a JSON object, got {type(body).__name__}")
    body = {k: v for k, v in body.items() if v is not None}
    for name, reason in _REFUSED.items():
        if body.get(name) not in (None, False, 0):
            raise InvalidRequestError(name, reason)
    chat = {name: body[name] for name in _SAME if name in body}
    names = ResponsesNames()
    chat["messages"] = _messages(body, names.message_paths)
    if "max_output_tokens" in body:
        chat["max_tokens"] = body["max_output_tokens"]
    if "tools" in body:
        chat["tools"] = _tools(body["tools"])
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    elif reasoning is not None and not isinstance(reasoning, dict):
        raise InvalidRequestError("reasoning", "must be an object such as {\"effort\": \"low\"}")
    # Anything else goes on as it is: the chat path ignores the fields it does not know, with one warning per name.
    chat |= {name: value for name, value in body.items() if name not in _HANDLED and name not in chat}
    truncation = body.get("truncation", "disabled")
    if truncation not in ("auto", "disabled"):
        raise InvalidRequestError("truncation", f"must be \"auto\" or \"disabled\", got {truncation!r}")
    if truncation == "auto":
        chat["truncate_prompt_tokens"] = -1  # keep the newest tokens that fit the context
    return chat, names


def _messages(body: dict[str, Any], paths: list[str]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequestError("instructions", "must be a string")
        messages.append({"role": "system", "content": instructions})
        paths.append("instructions")
    raw = body.get("input")
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
        paths.append("input")
        return messages
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError("input", "must be a string or a non-empty list of input items")
    thought = None  # a reasoning item's text, for the assistant turn that follows it
    for k, item in enumerate(raw):
        path = f"input[{k}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(path, "must be an input item object")
        kind = item.get("type", "message")
        if kind == "reasoning":
            thought = _reasoning_text(item, path)
            continue
        if kind == "message":
            message = {"role": item.get("role"), "content": _content(item.get("content"), f"{path}.content")}
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", path), "type": "function",
                    "function": {"name": _string(item, "name", path), "arguments": _string(item, "arguments", path)}}
            last = messages[-1] if messages else None
            if thought is None and last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # a turn's text and calls are one assistant message
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": _string(item, "call_id", path),
                       "content": _output_text(item.get("output"), f"{path}.output")}
        else:
            raise InvalidRequestError(f"{path}.type", f"unsupported input item {kind!r}; supported: message, "
                                      "function_call, function_call_output, reasoning")
        if message["role"] == "assistant" and thought is not None:
            message["reasoning"], thought = thought, None
        messages.append(message)
        paths.append(path)
    return messages


def _content(content: Any, path: str) -> Any:
    """A message's content: a string, or parts whose text types become the chat's text parts (others are passed on
    for the chat path to refuse by their path)."""
    if not isinstance(content, list):
        return content
    return [{"type": "text", "text": part.get("text")} if isinstance(part, dict) and part.get("type") in _TEXT_PARTS
            else part for part in content]


def _output_text(output: Any, path: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS for p in output):
        return "".join(str(p.get("text", "")) for p in output)
    raise InvalidRequestError(path, "must be a string or a list of text parts")


def _reasoning_text(item: dict[str, Any], path: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise InvalidRequestError(f"{path}.content", "must be a list of {\"type\": \"reasoning_text\", \"text\": ...}")
    return "".join(p["text"] for p in parts)


def _string(item: dict[str, Any], name: str, path: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{path}.{name}", f"must be a string, got {value!r}")
    return value


def _tools(raw: Any) -> Any:
    """Responses' flat function tools -> chat's {"type": "function", "function": {...}}."""
    if not isinstance(raw, list):
        raise InvalidRequestError("tools", "must be a list of function tools")
    tools = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidRequestError(f"tools[{i}].type", f"only function tools are supported, got {kind!r}")
        tools.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return tools


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise InvalidRequestError("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...}')


def _format(text: Any) -> dict[str, Any] | None:
    """`text.format` -> chat's response_format (None: plain text)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None and isinstance(text, dict):
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {"name": fmt.get("name", "response"), "schema": fmt.get("schema")}
        if "strict" in fmt:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequestError("text.format", 'must be {"type": "text"}, {"type": "json_object"} or '
                              '{"type": "json_schema", "name": ..., "schema": {...}}')
