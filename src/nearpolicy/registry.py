"""Name -> function registries filled by a decorator (advantage estimators, losses, corrections), and the "did you
mean" hint every unknown-name message shares."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


def did_you_mean(name: str, choices: Iterable[str], prefix: str = "") -> str:
    """" (did you mean 'x'?)" naming the closest one or two of `choices` to `name` (difflib ratio >= 0.6), each
    shown with `prefix` before it (a config key's section), else ""."""
    close = difflib.get_close_matches(str(name), list(choices), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(prefix + c) for c in close)}?)" if close else ""


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
            hint = did_you_mean(name, self._entries)
            raise KeyError(f"unknown {self.family} {name!r}{hint}; valid names: {valid}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __iter__(self) -> Iterator[Entry[F]]:
        return iter(self._entries[name] for name in self.names())
