"""OpenAI stream chunks from engine outputs (service/openai/openai_responses.py's ResponseBuilder): a reasoning
parser's and a tool parser's chunks carry what is new, and neither reads a choice's whole text per chunk (joined
from its history on every read: quadratic over a long stream)."""

from __future__ import annotations

import json

from stream_outputs import PROMPT, engine_outputs

from pagedserve.engine.reasoning import REASONING_FORMATS
from pagedserve.engine.requests import AdmittedRequest
from pagedserve.service.openai.openai_params import parse
from pagedserve.service.openai.openai_responses import ResponseBuilder
from pagedserve.service.openai.openai_tools import ToolSettings

CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 64}
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object",
                                                                            "properties": {"city": {"type": "string"}}}}}


def chunk_deltas(body: dict, pieces: list[str], **parse_kwargs) -> tuple[list[dict], int]:
    request = parse(body, chat=True, **parse_kwargs)
    admitted = (AdmittedRequest(PROMPT, request.params, truncated=False, thought_closed=False),)
    builder = ResponseBuilder(request, admitted, "chatcmpl-1", "tiny", decode=str)
    outputs, history = engine_outputs(pieces, "chatcmpl-1")
    deltas = [c["choices"][0]["delta"] for out in outputs for c in builder.chunks(0, out)]
    return deltas, history.walks


def test_reasoning_chunks_split_the_thought_without_joining_the_whole_text():
    pieces = ["<think>", "plan", " it", "</think>", "the", " answer"] + [f" w{i}" for i in range(200)]
    deltas, walks = chunk_deltas(CHAT, pieces, reasoning=REASONING_FORMATS.get("deepseek_r1"))
    assert "".join(d.get("reasoning", "") for d in deltas) == "plan it"
    assert "".join(d.get("content") or "" for d in deltas) == "the answer" + "".join(pieces[6:])
    assert walks == 0


def test_tool_call_chunks_parse_the_call_without_joining_the_whole_text():
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pieces = [call[i:i + 5] for i in range(0, len(call), 5)]
    deltas, walks = chunk_deltas({**CHAT, "tools": [TOOL]}, pieces, tools=ToolSettings(auto=True, parser="hermes"))
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls and calls[0]["function"]["name"] == "weather"
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {"city": "Paris"}
    assert walks == 0
