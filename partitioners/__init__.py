"""Partition strategies: one per module, each registered here under its name.

A strategy is a callable ``(joint: JointGraph, **options) -> saved nodes``; it only chooses,
``functrans.split`` does the surgery. Register your own with :func:`register`:

>>> import functrans as ft
>>> from functrans import partitioners
>>> def save_primals_only(joint):
...     return [n for n in joint.primals()]
>>> _ = partitioners.register("my_remat", save_primals_only, replace=True)
>>> "my_remat" in partitioners.names()
True
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from functrans.extend import Registry, Strategy

__all__ = ["examples", "get", "names", "register"]

_STRATEGIES: Registry[Strategy] = Registry("partition strategy")
_EXAMPLES: dict[str, tuple[dict[str, Any], ...]] = {}


def register(
    name: str,
    strategy: Strategy,
    *,
    aliases: Iterable[str] = (),
    replace: bool = False,
    examples: Sequence[dict[str, Any]] = ({},),
) -> Strategy:
    """Register ``strategy`` under ``name`` (and ``aliases``); returns it.

    ``examples`` are option sets the property suite runs the strategy with (strategies with a
    required option, like ``memory_budget``'s budget, list a few).
    """
    _STRATEGIES.register(name, strategy, aliases=aliases, replace=replace)
    _EXAMPLES[name] = tuple(dict(e) for e in examples)
    return strategy


def examples(name: str) -> tuple[dict[str, Any], ...]:
    """Option sets to exercise the strategy ``name`` with (``({},)`` unless registered)."""
    _STRATEGIES.get(name)
    return _EXAMPLES.get(name, ({},))


def get(name: str) -> Strategy:
    """The strategy registered as ``name``; unknown names list the registered ones."""
    return _STRATEGIES.get(name)


def names(*, aliases: bool = False) -> list[str]:
    """Names of every registered strategy (and their aliases with ``aliases=True``)."""
    return _STRATEGIES.names(aliases=aliases)


from . import default as default  # noqa: E402  (registers itself)
from . import full_remat as full_remat  # noqa: E402
from . import memory_budget as memory_budget  # noqa: E402
from . import min_cut as min_cut  # noqa: E402
