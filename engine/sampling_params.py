"""Per-request sampling and stopping settings, validated where they are built."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from pagedserve.engine.constraint import OutputConstraint, StructuredOutputsParams
from pagedserve.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_N = 64
# Bounds that keep every processed logit finite in fp32: penalties divide or multiply logits (|logit| < 1e4 in
# practice), biases add to them; OpenAI accepts the same bias range.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
PRESENCE_FREQUENCY_RANGE = (-2.0, 2.0)
_MAX_STOP_STRINGS = 16
_MAX_STOP_STRING_CHARS = 256
_MAX_BAD_WORDS = 256


def _finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidRequestError(name, f"must be a finite number, got {value!r}")


def _within(name: str, value: float, bounds: tuple[float, float]) -> None:
    # A bound's nearest float32 (what a proto float field carries, e.g. 0.01 -> 0.0099999998) counts as the bound.
    lo, hi = (b - abs(b) * 2**-23 if i == 0 else b + abs(b) * 2**-23 for i, b in enumerate(bounds))
    if not lo <= value <= hi:
        raise InvalidRequestError(name, f"must be in [{bounds[0]:g}, {bounds[1]:g}], got {value!r}")


def _integer(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidRequestError(name, f"must be >= {minimum}, got {value}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as vLLM) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the context is full (the admission sets the number)
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-n alternatives per generated token (the chosen token is always included)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (vLLM's prompt_logprobs)
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    constraint: OutputConstraint | None = None  # structured output (engine/constraint.py); compiled at admission
    # vLLM's offline spelling of the same: becomes `constraint` (compare=False: the constraint says it all)
    structured_outputs: StructuredOutputsParams | None = field(default=None, compare=False, hash=False)
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled (vLLM's allowed_token_ids)
    # vLLM's bad_words: strings never generated; the admission tokenizes them into bad_words_ids (with and without a
    # leading space, as vLLM does): a word's last token is banned while the output ends with the tokens before it.
    bad_words: tuple[str, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    skip_special_tokens: bool = True  # False: special tokens' text stays in the output (the ending token's never)
    # False: this request never gets speculative drafts, even on an engine that speculates (its tokens are the
    # same either way for greedy, and equally distributed for sampling; only the step cost differs)
    speculative: bool = True
    # vLLM's thinking_token_budget: a reasoning model's open thought takes at most this many tokens, then its end
    # marker is forced (engine/thought_budget.py); needs an engine with a reasoning parser. None: no limit
    thinking_token_budget: int | None = None
    # vLLM's offline SamplingParams(truncate_prompt_tokens=N): keep the prompt's last N tokens (-1: as many as fit);
    # the served front ends carry theirs on the GenerationRequest, and the admission checks either
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        self._normalise_sequences()
        self._validate_sampling()
        self._validate_stopping()

    def _normalise_sequences(self) -> None:
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequestError("stop", f"must be a string or a list of strings, got {type(self.stop).__name__}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, list)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise InvalidRequestError("stop_token_ids", "must be a list of integers")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if not isinstance(allowed, (tuple, list)) or not allowed or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in allowed):
                raise InvalidRequestError("allowed_token_ids", "must be a non-empty list of token ids (integers >= 0)")
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))
        words = self.bad_words
        if not isinstance(words, (tuple, list)) or not all(isinstance(w, str) and w.strip() for w in words):
            raise InvalidRequestError("bad_words", "must be a list of non-empty strings")
        if len(words) > _MAX_BAD_WORDS:
            raise InvalidRequestError("bad_words", f"at most {_MAX_BAD_WORDS} words, got {len(words)}")
        object.__setattr__(self, "bad_words", tuple(words))
        object.__setattr__(self, "bad_words_ids", tuple(tuple(ids) for ids in self.bad_words_ids))
        if not isinstance(self.skip_special_tokens, bool):
            raise InvalidRequestError("skip_special_tokens", f"must be true or false, got {self.skip_special_tokens!r}")

    def _take_structured_outputs(self) -> None:
        if not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequestError("structured_outputs", f"must be a StructuredOutputsParams, got "
                                                            f"{type(self.structured_outputs).__name__}")
        constraint = self.structured_outputs.constraint()
        if self.constraint is not None and self.constraint != constraint:
            raise InvalidRequestError("structured_outputs", "set either it or constraint, not both")
        object.__setattr__(self, "constraint", constraint)

    def _validate_sampling(self) -> None:
        _integer("n", self.n, 1)
        if self.n > MAX_N:
            raise InvalidRequestError("n", f"must be <= {MAX_N}, got {self.n}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            _finite(name, getattr(self, name))
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        _integer("top_k", self.top_k, -1)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)  # vLLM's older spelling of "off", which it still accepts
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        _within("repetition_penalty", self.repetition_penalty, REPETITION_PENALTY_RANGE)
        for name in ("presence_penalty", "frequency_penalty"):
            _within(name, getattr(self, name), PRESENCE_FREQUENCY_RANGE)
        if self.seed is not None:
            _integer("seed", self.seed, 0)
            if self.seed >= 2**63:
                raise InvalidRequestError("seed", "must be < 2**63")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _integer(name, value, 0)
                if value > MAX_LOGPROBS:
                    raise InvalidRequestError(name, f"must be <= {MAX_LOGPROBS}, got {value}")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                _integer("logit_bias", token, 0)
                _finite("logit_bias", bias)
                _within("logit_bias", bias, LOGIT_BIAS_RANGE)
        if self.structured_outputs is not None:
            self._take_structured_outputs()
        if self.constraint is not None and not isinstance(self.constraint, OutputConstraint):
            raise InvalidRequestError("constraint", f"must be an OutputConstraint, got {type(self.constraint).__name__}")
        if self.thinking_token_budget is not None:
            _integer("thinking_token_budget", self.thinking_token_budget, 0)
        if not isinstance(self.speculative, bool):
            raise InvalidRequestError("speculative", f"must be true or false, got {self.speculative!r}")
        if self.n > 1 and self.temperature == 0:
            raise InvalidRequestError("n", "n > 1 needs temperature > 0 (greedy samples would be identical)")

    def _validate_stopping(self) -> None:
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, 1)
        _integer("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"{self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if len(self.stop) > _MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {_MAX_STOP_STRINGS} stop strings")
        for s in self.stop:
            if not s:
                raise InvalidRequestError("stop", "stop strings must be non-empty")
            if len(s) > _MAX_STOP_STRING_CHARS:
                raise InvalidRequestError("stop", f"stop strings must be <= {_MAX_STOP_STRING_CHARS} characters")
        for token in self.stop_token_ids:
            if token < 0:
                raise InvalidRequestError("stop_token_ids", f"token ids must be >= 0, got {token}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def restricts_tokens(self) -> bool:
        return self.allowed_token_ids is not None or bool(self.bad_words_ids)

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """A copy limited to `max_tokens` (>= 1) new tokens, min_tokens capped to it; the other fields were
        checked when this one was built, so they are not checked again."""
        fitted = copy.copy(self)
        object.__setattr__(fitted, "max_tokens", max_tokens)
        object.__setattr__(fitted, "min_tokens", min(self.min_tokens, max_tokens))
        return fitted

    def with_bad_words_ids(self, ids: tuple[tuple[int, ...], ...]) -> SamplingParams:
        """A copy with bad_words tokenized (the admission does it, with the model's tokenizer)."""
        resolved = copy.copy(self)
        object.__setattr__(resolved, "bad_words_ids", ids)
        return resolved

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the client sent must exist in the model's vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", tuple(self.logit_bias or ())),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidRequestError(name, f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")
