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

    def register(self, name: str) -> Callable[[T], T]:
        def deco(entry: T) -> T:
            if name in self._entries and self._entries[name] is not entry:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._entries[name] = entry
            return entry

        return deco

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise UnknownImplementationError(f"unknown {self.kind} {name!r}; supported: {', '.join(self.names())}")
        return self._entries[name]
