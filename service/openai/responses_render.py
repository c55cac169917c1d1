"""A chat answer (service/openai/openai_responses.py's ResponseBuilder) rendered as OpenAI's Responses API: a
`response` object whose output items are the thought (`reasoning`), the text (`message` with `output_text`) and the
tool calls (`function_call`), or, streamed, the typed events that build it (`response.created`, items added, text,
thought and argument deltas, items done, `response.completed`), each with its sequence number.

A streamed response's final object is built from the items it streamed, so the two always agree.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from pagedserve.service.openai.openai_responses import DecodeIds, ResponseBuilder


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass(slots=True)
class _Item:
    kind: str  # "reasoning", "message" or "function_call"
    id: str
    text: str = ""  # the thought, the message's text, or the call's arguments
    call_id: str = ""
    name: str = ""
    done: bool = False

    def render(self, status: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": self.text}]}
        if self.kind == "message":
            return {"id": self.id, "type": "message", "role": "assistant", "status": status,
                    "content": [_output_text(self.text)]}
        return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": self.text, "status": status}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass(slots=True)
class ResponsesView:
    """One /v1/responses request's rendering. body: the request as the client sent it (echoed in the object)."""

    builder: ResponseBuilder
    body: dict[str, Any]
    decode_ids: DecodeIds
    id: str = field(default_factory=lambda: _id("resp"))
    items: list[_Item] = field(default_factory=list)
    calls: dict[int, _Item] = field(default_factory=dict)  # chat tool-call index -> its item
    sequence: int = 0
    done_marker = False  # the Responses API ends a stream with its last event, no [DONE]
    named_events = True  # each SSE event carries its type as `event:`

    # -- whole responses --------------------------------------------------------------------------------
    def whole(self) -> dict[str, Any]:
        choice = self.builder.response()["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        if message.get("reasoning"):
            self.items.append(_Item("reasoning", _id("rs"), message["reasoning"]))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            self.items.append(_Item("message", _id("msg"), message.get("content") or ""))
        for call in calls:
            function = call["function"]
            self.items.append(_Item("function_call", _id("fc"), function["arguments"], call["id"], function["name"]))
        return self._response(finish)

    # -- streams ---------------------------------------------------------------------------------------
    def opening(self) -> list[dict[str, Any]]:
        skeleton = self._object("in_progress", None, [], None)
        return [self._event("response.created", response=skeleton),
                self._event("response.in_progress", response=skeleton)]

    def chunks(self, prompt: int, output: Any) -> list[dict[str, Any]]:
        events = []
        for chunk in self.builder.chunks(prompt, output):
            delta = chunk["choices"][0]["delta"]
            if delta.get("reasoning"):
                events += self._text("reasoning", delta["reasoning"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
        return events

    def closing(self) -> list[dict[str, Any]]:
        events = self._close_open()
        finish = self.builder.choices[0].finish_reason
        final = self._response(finish)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=final)]

    # -- events ------------------------------------------------------------------------------------------
    def _text(self, kind: str, piece: str) -> list[dict[str, Any]]:
        events = []
        item = self.items[-1] if self.items and not self.items[-1].done else None
        if item is None or item.kind != kind:
            events += self._close_open()
            item = _Item(kind, _id("rs" if kind == "reasoning" else "msg"))
            events += self._open(item)
        item.text += piece
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [*events, self._event(name, item_id=item.id, output_index=self.items.index(item), content_index=0,
                                     delta=piece, **extra)]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events, arguments = [], call.get("function", {}).get("arguments") or ""
        if "id" in call:  # a new call: its first delta carries the id and the name
            events += self._close_open()
            item = _Item("function_call", _id("fc"), call_id=call["id"], name=call["function"]["name"])
            self.calls[call["index"]] = item
            events += self._open(item)
        item = self.calls[call["index"]]
        if arguments:
            item.text += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                      output_index=self.items.index(item), delta=arguments))
        return events

    def _open(self, item: _Item) -> list[dict[str, Any]]:
        self.items.append(item)
        index, events = len(self.items) - 1, []
        events.append(self._event("response.output_item.added", output_index=index,
                                  item=_Item(item.kind, item.id, "", item.call_id, item.name).render("in_progress")))
        if item.kind != "function_call":
            part = {"type": "reasoning_text", "text": ""} if item.kind == "reasoning" else _output_text("")
            events.append(self._event("response.content_part.added", item_id=item.id, output_index=index,
                                      content_index=0, part=part))
        return events

    def _close_open(self) -> list[dict[str, Any]]:
        if not self.items or self.items[-1].done:
            return []
        item, index = self.items[-1], len(self.items) - 1
        item.done = True
        where = {"item_id": item.id, "output_index": index}
        if item.kind == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, name=item.name,
                                  arguments=item.text)]
        else:
            rendered = item.render("completed")["content"][0]
            done = "response.reasoning_text.done" if item.kind == "reasoning" else "response.output_text.done"
            extra = {} if item.kind == "reasoning" else {"logprobs": []}
            events = [self._event(done, **where, content_index=0, text=item.text, **extra),
                      self._event("response.content_part.done", **where, content_index=0, part=rendered)]
        return [*events, self._event("response.output_item.done", output_index=index, item=item.render("completed"))]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    # -- the response object ----------------------------------------------------------------------------
    def _response(self, finish: str | None) -> dict[str, Any]:
        incomplete = finish not in ("stop", "tool_calls")
        status = "incomplete" if incomplete else "completed"
        details = {"reason": "max_output_tokens" if finish == "length" else None} if incomplete else None
        output = [item.render("incomplete" if incomplete and item is self.items[-1] else "completed")
                  for item in self.items]
        return self._object(status, details, output, self._usage())

    def _object(self, status: str, details: Any, output: list[Any], usage: Any) -> dict[str, Any]:
        body = self.body
        text = body.get("text") if isinstance(body.get("text"), dict) else {}
        return {
            "id": self.id, "object": "response", "created_at": self.builder.created, "status": status,
            "error": None, "incomplete_details": details, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata"),
            "model": self.builder.model, "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None, "reasoning": body.get("reasoning"), "store": False,
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "text": {"format": text.get("format") or {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools", []), "truncation": body.get("truncation", "disabled"), "usage": usage,
            "user": body.get("user"),
        }

    def _usage(self) -> dict[str, Any]:
        usage = self.builder.usage()
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
                "total_tokens": usage["total_tokens"]}

    def _reasoning_tokens(self) -> int:
        """The output tokens up to the one that closes the thought (all of them when it never closed)."""
        choice, reasoning = self.builder.choices[0], self.builder.request.reasoning
        thought = choice.thought
        if reasoning is None or thought is None or thought.content_only or not any(
                i.kind == "reasoning" for i in self.items):
            return 0
        ids, end = choice.token_ids, reasoning.format.end
        lo, hi = 1, len(ids)
        if end not in self.decode_ids(ids):
            return len(ids)
        while lo < hi:  # the shortest prefix whose text holds the end marker
            mid = (lo + hi) // 2
            if end in self.decode_ids(ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo
