"""A small typed name -> entry registry shared by attention impls, quant methods and model architectures."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class UnknownImplementationError(LookupError):
    """A registry lookup failed; the message lists the supported names."""


class Registry(Generic[T]):
    """Name -> entry (usually a class); lookup errors list the supported names."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._lazy: dict[str, Callable[[], T]] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(entry: T) -> T:
            if name in self._lazy or (name in self._entries and self._entries[name] is not entry):
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._entries[name] = entry
            return entry

        return deco

    def register_lazy(self, name: str, load: Callable[[], T]) -> None:
        """Register `name` now and import its entry on first `get` (for modules that import heavy packages)."""
        if name in self._entries or name in self._lazy:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self._lazy[name] = load

    def names(self) -> list[str]:
        return sorted([*self._entries, *self._lazy])

    def __contains__(self, name: str) -> bool:
        return name in self._entries or name in self._lazy

    def get(self, name: str) -> T:
        if name in self._lazy:
            self._entries[name] = self._lazy[name]()
            del self._lazy[name]
        if name not in self._entries:
            raise UnknownImplementationError(f"unknown {self.kind} {name!r}; supported: {', '.join(self.names())}")
        return self._entries[name]
