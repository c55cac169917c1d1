"""What the client hands back: plain typed dataclasses, independent of the generated proto classes."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.v1 import generate_pb2 as pb


class FinishReason(str, enum.Enum):
    MAX_TOKENS = "max_tokens"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    STOP_TOKEN = "stop_token"
    CANCELLED = "cancelled"
    TIME_LIMIT = "time_limit"
    CONTEXT_LIMIT = "context_limit"
    CONSTRAINT_DEAD_END = "constraint_dead_end"  # the constraint admitted no further token; the text is a prefix
    UNSPECIFIED = "unspecified"

    @classmethod
    def from_proto(cls, value: int) -> FinishReason:
        name = pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()
        return cls(name) if name in cls._value2member_map_ else cls.UNSPECIFIED


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @classmethod
    def from_proto(cls, u: pb.Usage) -> Usage:
        return cls(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


@dataclass(frozen=True, slots=True)
class Timing:
    queue_seconds: float
    time_to_first_token_seconds: float
    decode_seconds: float
    total_seconds: float
    num_preemptions: int

    @classmethod
    def from_proto(cls, t: pb.Timing) -> Timing:
        return cls(t.queue_seconds, t.time_to_first_token_seconds, t.decode_seconds, t.total_seconds,
                   t.num_preemptions)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first
    rank: int | None = None  # 1 + how many tokens scored higher (prompt logprobs carry it)

    @classmethod
    def from_proto(cls, lp: pb.TokenLogprob) -> TokenLogprob:
        return cls(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top),
                   lp.rank if lp.HasField("rank") else None)


@dataclass(frozen=True, slots=True)
class Started:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    truncated: bool
    seed: int | None
    # prompt_logprobs=k asked for: entry i scores prompt token i + 1 (the first prompt token has no score)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    @classmethod
    def from_proto(cls, s: pb.Started) -> Started:
        return cls(s.request_id, s.prompt_tokens, s.cached_tokens, s.truncated,
                   s.seed if s.HasField("seed") else None,
                   tuple(TokenLogprob.from_proto(lp) for lp in s.prompt_logprobs))


@dataclass(frozen=True, slots=True)
class Delta:
    """New output of one completion: text may be empty while a multi-byte character is incomplete."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    reasoning: str = ""  # a reasoning model's thought, as it grows (a server with --reasoning-parser, chat input)

    @classmethod
    def from_proto(cls, index: int, d: pb.Delta) -> Delta:
        return cls(index, d.text, tuple(d.token_ids), tuple(TokenLogprob.from_proto(lp) for lp in d.logprobs),
                   d.reasoning)


@dataclass(frozen=True, slots=True)
class Final:
    index: int
    finish_reason: FinishReason
    stop_sequence: str | None
    stop_token_id: int | None
    usage: Usage
    timing: Timing

    @classmethod
    def from_proto(cls, index: int, f: pb.Final) -> Final:
        which = f.WhichOneof("matched_stop")
        return cls(index, FinishReason.from_proto(f.finish_reason),
                   f.stop_sequence if which == "stop_sequence" else None,
                   f.stop_token_id if which == "stop_token_id" else None,
                   Usage.from_proto(f.usage), Timing.from_proto(f.timing))


@dataclass(slots=True)
class Completion:
    """One finished completion, assembled from its deltas and its final frame."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    final: Final | None = None
    reasoning: str = ""  # the model's thought, apart from `text` (a server with --reasoning-parser, chat input)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.final.finish_reason if self.final else None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.reasoning += delta.reasoning
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)


@dataclass(frozen=True, slots=True)
class Tokenization:
    token_ids: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...]  # UTF-8 byte spans into the text, when requested
