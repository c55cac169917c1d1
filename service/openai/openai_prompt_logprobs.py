"""The prompt's logprobs (engine RequestOutput.prompt_logprobs) in the shapes clients read: vLLM's `prompt_logprobs`
(a completion choice's field, the chat response's: None for the first prompt token, then per token an object keyed
by token id with the prompt token and the k best, each {logprob, rank, decoded_token}), and completions' `echo`
with `logprobs` (the prompt's tokens ahead of the generated ones in the legacy lists, the first one's logprob null),
as lm-evaluation-harness reads them to score a continuation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.core.sequence import TokenLogprob

# JSON has no infinities: vLLM reports -inf (and we also NaN) as this.
LOGPROB_FLOOR = -9999.0

Decode = Callable[[int], str]


def clamp(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _entry(logprob: float, rank: int | None, token: str) -> dict[str, Any]:
    return {"logprob": clamp(logprob), "rank": rank, "decoded_token": token}


def vllm_prompt_logprobs(scores: tuple[TokenLogprob | None, ...], decode: Decode) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = []
    for lp in scores:
        if lp is None:
            out.append(None)
            continue
        item = {str(lp.token_id): _entry(lp.logprob, lp.rank, decode(lp.token_id))}
        for rank, (token, value) in enumerate(lp.top, start=1):
            item.setdefault(str(token), _entry(value, rank, decode(token)))
        out.append(item)
    return out


@dataclass(slots=True)
class EchoLogprobs:
    """The legacy completions logprobs lists for the echoed prompt; `text_offset` ends where the output's begin."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    end: int = 0

    @staticmethod
    def of(prompt_ids: tuple[int, ...], scores: tuple[TokenLogprob | None, ...], decode: Decode) -> EchoLogprobs:
        echo = EchoLogprobs()
        for token_id, lp in zip(prompt_ids, scores):
            token = decode(token_id)
            echo.tokens.append(token)
            echo.text_offset.append(echo.end)
            echo.end += len(token)
            if lp is None:
                echo.token_logprobs.append(None)
                echo.top_logprobs.append(None)
            else:
                echo.token_logprobs.append(clamp(lp.logprob))
                top = {token: clamp(lp.logprob)}  # the prompt token itself, as the generated tokens' lists have it
                top.update((decode(t), clamp(v)) for t, v in lp.top)
                echo.top_logprobs.append(top)
        return echo

    def ahead_of(self, generated: dict[str, Any]) -> dict[str, Any]:
        """The whole choice's lists: these, then the generated tokens' (rendered from text offset `end` on)."""
        return {"tokens": self.tokens + generated["tokens"],
                "token_logprobs": self.token_logprobs + generated["token_logprobs"],
                "top_logprobs": self.top_logprobs + generated["top_logprobs"],
                "text_offset": self.text_offset + generated["text_offset"]}
