"""The trace session: the one trace-time context variable of :mod:`functrans._trace`.

What a trace does besides ``make_fx`` depends on state its extensions keep while it runs: the
regions of the joint trace and whether a region's own trace is running, the blocks found, the
reads recorded for the guards, the random-number seeding. Each piece is a :class:`Slot`,
declared (typed, named, with a default) by the module that owns it; all of them live in one
mapping held by one ``ContextVar``, so a trace's whole state is one value (:func:`current`),
a thread or a copied context (``contextvars.copy_context()``) sees its own, and nothing else in
``_trace`` is ambient (``tests/project/test_declared_tables.py`` checks that no other module
of ``_trace`` makes a ``ContextVar``).

Setting a slot returns a token; resetting with it restores that slot alone, as a context
variable of its own would: a reset out of order leaves the other slots as they are. The
mapping is never changed in place, so a context copied mid-trace keeps what it saw.

>>> depth = Slot("doctest depth", 0)
>>> depth.get()
0
>>> with depth.bound(2):
...     depth.get(), current()["doctest depth"]
(2, 2)
>>> depth.get(), "doctest depth" in current()
(0, False)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, TypeVar

__all__ = ["Slot", "SlotToken", "current"]

_T = TypeVar("_T")

#: the session: slot -> value for every slot set in this context (never changed in place)
_STATE: contextvars.ContextVar[Mapping[Slot[Any], Any]] = contextvars.ContextVar(
    "functrans_trace_session", default=MappingProxyType({})
)

_UNSET: Any = object()


@dataclass(frozen=True)
class SlotToken(Generic[_T]):
    """What :meth:`Slot.set` returns: the slot and the value it had (or none)."""

    slot: Slot[_T]
    old: Any


class Slot(Generic[_T]):
    """One piece of the trace session's state, owned by the module that declares it.

    >>> inside = Slot("doctest inside", False)
    >>> token = inside.set(True)
    >>> inside.get()
    True
    >>> inside.reset(token)
    >>> inside.get()
    False
    """

    __slots__ = ("default", "name")

    def __init__(self, name: str, default: _T) -> None:
        self.name = name
        self.default = default

    def __repr__(self) -> str:
        return f"Slot({self.name!r})"

    def get(self) -> _T:
        """The slot's value in this context (its default where it is not set)."""
        value: _T = _STATE.get().get(self, self.default)
        return value

    def set(self, value: _T) -> SlotToken[_T]:
        """Set the slot in this context; :meth:`reset` with the token puts its value back."""
        state = _STATE.get()
        _STATE.set({**state, self: value})
        return SlotToken(self, state.get(self, _UNSET))

    def reset(self, token: SlotToken[_T]) -> None:
        """Put back the value the slot had when :meth:`set` gave ``token``."""
        if token.slot is not self:
            raise ValueError(f"{token.slot!r}'s token given to {self!r}")
        state = dict(_STATE.get())
        if token.old is _UNSET:
            state.pop(self, None)
        else:
            state[self] = token.old
        _STATE.set(state)

    @contextlib.contextmanager
    def bound(self, value: _T) -> Iterator[None]:
        """The slot set to ``value`` for the body."""
        token = self.set(value)
        try:
            yield
        finally:
            self.reset(token)


def current() -> dict[str, Any]:
    """The session of this context: each slot set, by name, and its value."""
    return {slot.name: value for slot, value in _STATE.get().items()}
