"""The interface a grammar library fills: compile a constraint for one tokenizer, then match sequences against it.

A backend is built once per engine (its tokenizer is fixed); `compile` may run on any thread and is called off the
step loop; matchers are used by the step loop only. Implementations are named in `registry.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.engine.constraint import OutputConstraint
from pagedserve.engine.core.seq_features import SeqFeature
from pagedserve.engine.reasoning import ThoughtMarker


class ConstraintRejected(ValueError):
    """The grammar library refused the constraint; the message is the library's reason."""


class ConstraintMatcher(ABC):
    """One sequence's position in its grammar. Advanced only by tokens the sequence really appends."""

    vocab_words: int  # int32 words per bitmask row: ceil(the grammar's vocabulary / 32)

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into bitmask[row] (int32 words, bit t % 32 of word t // 32 set = allowed)."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advances past `token`; False when the grammar does not allow it (the matcher is then unusable)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and allows no further token: the sequence ends here."""

    @abstractmethod
    def fork(self) -> "ConstraintMatcher":
        """An independent copy at the same position (a sibling sample continues from here on its own)."""


class GrammarBackend(ABC):
    """One grammar library bound to one tokenizer and vocabulary width (the model's logits)."""

    name: str

    @abstractmethod
    def compile(self, constraint: OutputConstraint) -> Any:
        """The library's compiled grammar; raises ConstraintRejected with the library's reason."""

    @abstractmethod
    def matcher(self, compiled: Any) -> ConstraintMatcher:
        """A fresh matcher at the start of `compiled`."""


@dataclass(slots=True)
class GrammarState(SeqFeature):
    """A constrained sequence's matcher, advanced only by appended tokens (recompute after preemption and chunked
    prefill never replay it). Behind a reasoning model's thought (`waits_for`), the grammar neither masks nor
    advances until the output closes the thought; the sequence still counts as constrained meanwhile (no speculation,
    no step launched ahead), so the token that closes it is never followed by an unmasked one."""

    matcher: ConstraintMatcher
    waits_for: ThoughtMarker | None = None  # None: the grammar applies to the next token

    @property
    def applies(self) -> bool:
        return self.waits_for is None

    def watch(self, token: int, text_tail: str) -> None:
        """After an appended token, while waiting: the grammar applies from the next token once the thought closed."""
        if self.waits_for is not None and self.waits_for.seen(token, text_tail):
            self.waits_for = None

    def fork(self, index: int) -> GrammarState:
        return GrammarState(self.matcher.fork(), self.waits_for)


@dataclass(frozen=True, slots=True)
class CompiledConstraint:
    """What admission hands the engine: the compiled grammar and the backend that makes its matchers."""

    constraint: OutputConstraint
    compiled: Any
    backend: GrammarBackend
    compile_seconds: float  # 0.0 when it came from the cache

    def new_matcher(self) -> ConstraintMatcher:
        return self.backend.matcher(self.compiled)
