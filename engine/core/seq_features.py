"""Per-sequence feature state: one small dataclass per feature, held by `Sequence.features` under its class.

A feature (seeded sampling, the grammar matcher, the LoRA adapter's weights, speculation's back-off, the incremental
detokenizer) keeps whatever it needs per sequence in its own `SeqFeature` subclass, defined beside the code that
reads it; the core never looks inside. `Sequence.fork` asks every state for its sibling's copy (`SeqFeature.fork`),
so a new feature is forked correctly by being a `SeqFeature`: nothing else copies feature state.
"""

from __future__ import annotations

from typing import TypeVar

F = TypeVar("F", bound="SeqFeature")

# Every feature class by its qualified name: what a sequence may hold (tests check each one forks). By name: a
# slotted dataclass is a second class made from the first, and the second replaces it here.
FEATURE_KINDS: dict[str, type[SeqFeature]] = {}


class SeqFeature:
    """Base of one feature's per-sequence state (a slotted dataclass)."""

    __slots__ = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        FEATURE_KINDS[f"{cls.__module__}.{cls.__qualname__}"] = cls

    def fork(self, index: int) -> SeqFeature | None:
        """The state sibling sample `index` starts with (None: without this feature). Called before the parent
        appends the token the fork happens on."""
        raise NotImplementedError(f"{type(self).__name__}.fork")


class SeqFeatures(dict):
    """A sequence's feature states by their class (a plain dict underneath: a lookup costs one dict probe)."""

    __slots__ = ()

    def of(self, kind: type[F]) -> F | None:
        return self.get(kind)

    def attach(self, state: SeqFeature) -> None:
        self[type(state)] = state

    def fork(self, index: int) -> SeqFeatures:
        child = SeqFeatures()
        for kind, state in self.items():
            copy = state.fork(index)
            if copy is not None:
                child[kind] = copy
        return child
