"""On-disk cache of traced graphs across processes (issue 19): a stub that always traces.

:func:`traced` is called by ``jit`` around each trace; it returns the graph ``make`` builds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["DiskKey", "traced"]

_G = TypeVar("_G")


@dataclass(frozen=True)
class DiskKey:
    """What decides one trace of a jitted function (everything its disk key must cover)."""

    fn: Callable[..., Any]  # the user's function (what jit wraps)
    kind: str  # "forward" (inference entry: trace) or "joint" (training entry: joint)
    options: Any  # jit's _Options (strategy, backend, static_argnums, decompositions, ...)
    state: Any  # functrans._state.State at the call
    flat: Any  # the call's Flat (structure and static leaves)
    tensors: tuple[Any, ...]  # the call's tensor inputs, in the traced function's order
    names: tuple[str, ...]  # readable names of those tensors
    decompositions: Any  # the decompositions actually used


def traced(key: DiskKey, make: Callable[[], _G]) -> _G:
    """The graph ``make()`` returns, from disk when a sound key finds it there."""
    return make()
