"""A tiny name -> object registry shared by partition strategies and codegen backends."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from .errors import UnknownNameError

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names (and aliases) to objects; unknown names raise an error listing known ones.

    >>> r: Registry[int] = Registry("number")
    >>> r.register("one", 1, aliases=("uno",))
    1
    >>> r.get("uno"), r.names(), r.names(aliases=True)
    (1, ['one'], ['one', 'uno'])
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._aliases: set[str] = set()

    def register(
        self, name: str, obj: T, *, aliases: Iterable[str] = (), replace: bool = False
    ) -> T:
        """Register ``obj`` as ``name`` and ``aliases``; refuse to shadow without ``replace``."""
        aliases = tuple(aliases)
        for key in (name, *aliases):
            if key in self._items and not replace and self._items[key] is not obj:
                raise ValueError(
                    f"a {self.kind} named {key!r} is already registered; pass replace=True to "
                    "override it"
                )
        for key in (name, *aliases):
            self._items[key] = obj
        self._aliases.discard(name)
        self._aliases.update(aliases)
        return obj

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(repr(n) for n in self.names(aliases=True)) or "none"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; registered: {known}") from None

    def names(self, *, aliases: bool = False) -> list[str]:
        """Registered names, sorted; with ``aliases=True`` the aliases too."""
        return sorted(k for k in self._items if aliases or k not in self._aliases)

    def __contains__(self, name: object) -> bool:
        return name in self._items
