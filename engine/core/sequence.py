"""One sequence: a prompt plus the tokens sampled for it. A request with n > 1 owns n sequences."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from pagedserve.engine.core.seq_features import SeqFeatures
from pagedserve.engine.lora.config import AdapterInfo
from pagedserve.engine.pooling import PoolingState
from pagedserve.engine.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # this request's logits went non-finite; its batch mates are unaffected
    # Its constraint allows no further token (nor the end) before it was satisfied: only this sequence ends, with
    # the text so far; not an error (vLLM #18783 failed the whole request instead).
    CONSTRAINT_DEAD_END = "constraint_dead_end"


@dataclass(slots=True)
class SequenceMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first
    rank: int | None = None  # 1 + how many tokens scored higher (prompt logprobs report it, as vLLM's do)


class OutputText:
    """A sequence's detokenized text, kept as the pieces appended: appending, the length and text near the end cost
    what the piece costs, never the whole text (a str grown by += is copied on every append)."""

    __slots__ = ("pieces", "length")

    def __init__(self) -> None:
        self.pieces: list[str] = []  # append-only; truncate() replaces the list, so earlier readers keep theirs
        self.length = 0

    def append(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)
            self.length += len(piece)

    def tail(self, start: int) -> str:
        """text[start:], for a start near the end."""
        parts, covered = [], self.length
        for piece in reversed(self.pieces):
            if covered <= start:
                break
            parts.append(piece)
            covered -= len(piece)
        return "".join(reversed(parts))[max(0, start - covered):]

    def truncate(self, length: int) -> None:
        """Cut at a stop string: once per sequence, so joining the whole text here is fine."""
        text = self.value()[:length]
        self.pieces, self.length = [text] if text else [], len(text)

    def value(self) -> str:
        return "".join(self.pieces)


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    metrics: SequenceMetrics
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SeqStatus = SeqStatus.WAITING
    # "num_computed_tokens catches up with num_tokens": prefill, chunked prefill, decode and recompute after
    # preemption are all the same thing, a gap between these two numbers.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hash chain of this sequence's committed full blocks
    pending_forks: int = 0  # extra samples (n - 1) still to be forked off after the first sampled token
    adapter: AdapterInfo | None = None  # the request's LoRA adapter (None: the base); part of the prefix-cache key
    cache_salt: int | None = None  # the request's cache salt key (engine/admission.py salt_key); part of it too
    priority: int = 0  # lower is scheduled earlier under the priority policy (engine/core/scheduling_policy.py)
    # Every feature's own state (seeded sampling, grammar matcher, adapter weights, speculation back-off, the
    # detokenizer): `engine/core/seq_features.py`.
    features: SeqFeatures = field(default_factory=SeqFeatures)
    text: OutputText = field(default_factory=OutputText)
    emitted_text_len: int = 0
    emitted_token_len: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: entry i scores prompt token i + 1 (the first token has none)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed: its prefill must run on every prompt position (no
        prefix-cache hit), as vLLM does for such requests."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def needs_every_position(self) -> bool:
        """Its prefill reads the hidden state of every prompt position (prompt logprobs, mean or first-token
        pooling), so it takes no prefix-cache hit."""
        pooling = self.features.of(PoolingState)
        return self.needs_prompt_logprobs or (pooling is not None and pooling.needs_every_position)

    @property
    def adapter_name(self) -> str | None:
        return None if self.adapter is None else self.adapter.name

    @property
    def adapter_id(self) -> int:
        """0 for the base model."""
        return 0 if self.adapter is None else self.adapter.adapter_id

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def fork(self, index: int) -> "Sequence":
        """A sibling sample sharing everything computed so far, each feature's state forked; blocks are shared by
        the block manager."""
        child = Sequence(
            request_id=self.request_id,
            index=index,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            params=self.params,
            metrics=SequenceMetrics(
                arrival_time=self.metrics.arrival_time,
                first_scheduled_time=self.metrics.first_scheduled_time,
                num_cached_tokens=self.metrics.num_cached_tokens,
            ),
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            block_hashes=list(self.block_hashes),
            adapter=self.adapter,
            cache_salt=self.cache_salt,
            priority=self.priority,
            features=self.features.fork(index),
        )
        return child

    def unforked_samples(self, reason: FinishReason) -> list["Sequence"]:
        """The n > 1 samples still to fork off this one's first token, ended with it (`reason`) before they ever
        ran: a request ending before its first token still reports n outputs. Takes no blocks."""
        ended = []
        for index in range(1, self.pending_forks + 1):
            child = self.fork(index)
            child.status, child.finish_reason, child.metrics.finished_time = SeqStatus.FINISHED, reason, now()
            ended.append(child)
        self.pending_forks = 0
        return ended


def now() -> float:
    return time.monotonic()
