"""Name -> function registries filled by a decorator (advantage estimators, losses, corrections)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class Entry(Generic[F]):
    name: str
    fn: F
    summary: str
    source: str


class Registry(Generic[F]):
    """A dict of named functions; registering a name twice or looking up an unknown one raises."""

    def __init__(self, family: str):
        self.family = family
        self._entries: dict[str, Entry[F]] = {}

    def register(self, name: str, *, summary: str, source: str) -> Callable[[F], F]:
        def decorate(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.family} {name!r} is already registered")
            self._entries[name] = Entry(name, fn, summary, source)
            return fn

        return decorate

    def get(self, name: str) -> F:
        try:
            return self._entries[name].fn
        except KeyError:
            valid = ", ".join(sorted(self._entries))
            raise KeyError(f"unknown {self.family} {name!r}; valid names: {valid}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __iter__(self) -> Iterator[Entry[F]]:
        return iter(self._entries[name] for name in self.names())
