"""Engine outputs (deltas, from service/core/stream.py) -> OpenAI JSON: whole responses, SSE chunks, logprobs and
usage in OpenAI's shapes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.core.sequence import TokenLogprob
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.engine.requests import AdmittedRequest, TokensPrompt
from pagedserve.service.core.thought_reader import ThoughtReader
from pagedserve.service.openai.openai_params import OpenAIRequest, PromptInput
from pagedserve.service.openai.openai_prompt_logprobs import EchoLogprobs, vllm_prompt_logprobs
from pagedserve.service.openai.tool_parsers.stream import ToolCallStream

# The engine's finish reasons -> OpenAI's. A constraint's dead end passes as the engine's own value (the text is only
# a prefix of a valid output, which "stop" would hide); the other ends of a request are vLLM's "abort".
_FINISH = {"stop": "stop", "length": "length", "constraint_dead_end": "constraint_dead_end"}

Decode = Callable[[int], str]  # one token id -> its text
DecodeIds = Callable[[tuple[int, ...]], str]  # token ids -> their text, special tokens kept


def _echo_text(prompt: PromptInput, decode_ids: DecodeIds | None) -> str:
    """What `echo` puts before the output: the prompt's text, or the client's token ids decoded (as vLLM echoes
    them)."""
    if isinstance(prompt.request.prompt, TokensPrompt) and decode_ids is not None:
        return decode_ids(prompt.request.prompt.token_ids)
    return prompt.text


@dataclass(slots=True)
class _Choice:
    last: CompletionOutput | None = None  # the latest output: its history is the choice's text, ids and logprobs
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_offset: int = 0  # completions' logprobs.text_offset: characters before the next token
    started: bool = False  # chat streams: the role chunk was sent
    tool: ToolCallStream | None = None  # tools: the text is read back as content and tool_calls
    thought: ThoughtReader | None = None  # --reasoning-parser: the text is a thought, then content
    # A stream's text so far, grown by each output's new text: what the tool and thought readers read on every
    # chunk (`text` joins the whole history on every read: quadratic over a long stream)
    streamed: str = ""

    @property
    def text(self) -> str:
        return self.last.text if self.last is not None else ""

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.last.token_ids if self.last is not None else ()

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...]:
        return self.last.logprobs if self.last is not None else ()

    @property
    def num_tokens(self) -> int:
        return self.last.num_tokens if self.last is not None else 0


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


class ResponseBuilder:
    """Per request: accumulates what the engine produced for each choice and renders it the OpenAI way."""

    def __init__(self, request: OpenAIRequest, admitted: tuple[AdmittedRequest, ...], response_id: str, model: str,
                 decode: Decode, decode_ids: DecodeIds | None = None):
        self.request, self.id, self.model, self.decode = request, response_id, model, decode
        # a logprob's token: its text, or vLLM's return_tokens_as_token_ids form, "token_id:42"
        self.token_text = _token_id_text if request.tokens_as_ids else decode
        self.echoed = [_echo_text(p, decode_ids) if request.echo else "" for p in request.prompts]
        self.created = int(time.time())
        self.object = "chat.completion" if request.chat else "text_completion"
        self.n = request.params.n
        reasoning = request.reasoning
        self.choices = [_Choice(tool=request.tools.stream(),
                                thought=reasoning.reader(admitted[i // self.n].thought_closed) if reasoning else None)
                        for i in range(self.n * len(request.prompts))]
        self.prompt_tokens = sum(len(a.prompt_token_ids) for a in admitted)
        self.cached_tokens = 0
        # per prompt, once the engine scored it (SamplingParams.prompt_logprobs): (its token ids, its logprobs)
        self.prompt_scores: list[tuple[tuple[int, ...], tuple[TokenLogprob | None, ...]] | None] = \
            [None] * len(request.prompts)

    @property
    def all_finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    # -- whole responses --------------------------------------------------------------------------------
    def add(self, prompt: int, output: RequestOutput) -> None:
        """prompt: which prompt of the request this engine output answers (choice index = prompt * n + i)."""
        self.cached_tokens = output.metrics.num_cached_tokens
        if output.prompt_logprobs is not None:
            self.prompt_scores[prompt] = (output.prompt_token_ids, output.prompt_logprobs)
        for completion in output.outputs:
            choice = self.choices[prompt * self.n + completion.index]
            if choice.finish_reason is None:
                self._record(choice, completion)

    def response(self) -> dict[str, Any]:
        # each prompt's scores rendered once, however many of its n choices carry them
        scores = [self._rendered_scores(p) for p in range(len(self.request.prompts))]
        choices = [self._whole_choice(i, c, *scores[i // self.n]) for i, c in enumerate(self.choices)]
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}
        if self.request.chat and self.request.params.prompt_logprobs is not None:
            body["prompt_logprobs"] = scores[0][0]
        return body

    def _rendered_scores(self, prompt: int) -> tuple[list[dict[str, Any] | None] | None, EchoLogprobs | None]:
        """A prompt's logprobs as vLLM's `prompt_logprobs` field, and as completions' echo lists (None: not asked)."""
        scored = self.prompt_scores[prompt]
        if scored is None:
            return None, None
        echo = EchoLogprobs.of(*scored, self.token_text) if self.request.echo and not self.request.chat else None
        return vllm_prompt_logprobs(scored[1], self.decode), echo

    def _whole_choice(self, index: int, choice: _Choice, prompt_logprobs: list[dict[str, Any] | None] | None,
                      echo: EchoLogprobs | None) -> dict[str, Any]:
        text, prompt = choice.text, index // self.n
        if echo is not None:
            choice.text_offset = echo.end
        logprobs = self._logprobs(choice, choice.logprobs) if self.request.params.logprobs is not None else None
        if logprobs is not None and echo is not None:
            logprobs = echo.ahead_of(logprobs)
        out: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": choice.finish_reason,
                               "stop_reason": choice.stop_reason}
        if not self.request.chat and self.request.params.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs
        if self.request.chat:
            out["message"] = self._message(choice, self._echo(prompt) + text)
            out["finish_reason"] = self._finish_reason(choice)
        else:
            out["text"] = self._echo(prompt) + text
        if self.request.return_token_ids:
            out["token_ids"] = list(choice.token_ids)
        return out

    def _message(self, choice: _Choice, text: str) -> dict[str, Any]:
        """A whole chat message: the thought (with a reasoning parser), content and tool calls read from `text`."""
        message: dict[str, Any] = {"role": self.request.role}
        if choice.thought is not None:
            reasoning, text = choice.thought.whole(text)
            message["reasoning"] = reasoning
        message["content"] = text if choice.thought is None else (text or None)
        if choice.tool is not None:
            message["content"], message["tool_calls"] = choice.tool.message(text)
        return message

    def usage(self) -> dict[str, Any]:
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    # -- streams -----------------------------------------------------------------------------------------
    def chunks(self, prompt: int, output: RequestOutput) -> list[dict[str, Any]]:
        """The chunks for one engine output: per choice, a role chunk first (chat), then its new text."""
        self.cached_tokens = output.metrics.num_cached_tokens
        chunks = []
        for completion in output.outputs:
            index = prompt * self.n + completion.index
            choice = self.choices[index]
            if choice.finish_reason is not None:
                continue
            if self.request.chat and not choice.started:
                chunks.append(self._chunk(index, {"role": self.request.role, "content": ""}, None, None))
            first = not choice.started
            choice.started = True
            new_logprobs = self._record(choice, completion)
            if choice.tool is not None or choice.thought is not None:
                choice.streamed += completion.new_text
            text = completion.new_text
            if first:
                text = self._echo(prompt) + text
            if text or completion.new_token_ids or choice.finish_reason is not None:
                logprobs = self._logprobs(choice, new_logprobs) if self.request.params.logprobs is not None else None
                body = self._delta_body(choice, text)
                if body == {} and choice.finish_reason is None and logprobs is None \
                        and not self.request.return_token_ids:
                    continue  # a tool-call format holds this text back: nothing to say yet (OpenAI sends no chunk)
                chunks.append(self._chunk(index, body, logprobs, choice, completion.new_token_ids))
        return chunks

    def _delta_body(self, choice: _Choice, text: str) -> Any:
        if not self.request.chat:
            return text
        if choice.tool is None and choice.thought is None:
            return {"content": text}
        final, content, body = choice.finish_reason is not None, choice.streamed, {}
        if choice.thought is not None:
            reasoning, content = choice.thought.advance(content, final)
            if reasoning:
                body["reasoning"] = reasoning
        if choice.tool is not None:
            body.update(choice.tool.delta(content, final))
        elif piece := choice.thought.new_content(content):
            body["content"] = piece
        return body

    def _finish_reason(self, choice: _Choice) -> str | None:
        """"tool_calls" when the model stopped after calling tools (a named function keeps "stop", as OpenAI and
        vLLM answer it)."""
        called = choice.tool is not None and choice.tool.called and not self.request.tools.named
        return "tool_calls" if choice.finish_reason == "stop" and called else choice.finish_reason

    def _echo(self, prompt: int) -> str:
        return self.echoed[prompt]

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage()}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.request.chat else "text_completion"

    def _chunk(self, index: int, body: Any, logprobs: Any, choice: _Choice | None,
               token_ids: tuple[int, ...] = ()) -> dict[str, Any]:
        finish = self._finish_reason(choice) if choice else None
        item: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            item["stop_reason"] = choice.stop_reason
        if self.request.chat:
            item["delta"] = body
        else:
            item["text"] = body
        if self.request.return_token_ids:
            item["token_ids"] = list(token_ids)
        chunk = {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                 "choices": [item]}
        if self.request.continuous_usage:
            chunk["usage"] = self.usage()
        elif self.request.include_usage:
            chunk["usage"] = None
        return chunk

    # -- shared ------------------------------------------------------------------------------------------
    def _record(self, choice: _Choice, completion: CompletionOutput) -> list[TokenLogprob]:
        choice.last = completion
        new = list(completion.new_logprobs)
        if completion.finish_reason is not None:
            choice.finish_reason = _FINISH.get(completion.finish_reason, "abort")
            choice.stop_reason = self._stop_reason(completion.stop_reason)
        return new

    def _stop_reason(self, reason: str | int | None) -> str | int | None:
        if isinstance(reason, str) or (isinstance(reason, int) and reason in self.request.params.stop_token_ids):
            return reason
        return None  # end of sequence, or a length limit

    def _logprobs(self, choice: _Choice, entries: list[Any]) -> dict[str, Any]:
        if self.request.chat:
            return {"content": [self._chat_logprob(lp) for lp in entries]}
        tokens = [self.token_text(lp.token_id) for lp in entries]
        offsets = []
        for token in tokens:
            offsets.append(choice.text_offset)
            choice.text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in entries],
                "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in entries], "text_offset": offsets}

    def _chat_logprob(self, lp: Any) -> dict[str, Any]:
        token = self.token_text(lp.token_id)
        top = [self._token_logprob(t, v) for t, v in lp.top]
        return {**self._token_logprob(lp.token_id, lp.logprob, token), "top_logprobs": top}

    def _token_logprob(self, token_id: int, logprob: float, token: str | None = None) -> dict[str, Any]:
        token = self.token_text(token_id) if token is None else token
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
