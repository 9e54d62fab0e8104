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

The registry fills itself on first use (importing this package loads no strategy): every public
module of this package (each ends with one ``register(...)`` call), then the installed plugins,
the entry points of group ``functrans.partitioners``. An entry point names a strategy callable
(registered under the entry point's name, run by the property suite with no options) or a module
that calls :func:`register` itself (to give aliases or example options)::

    [project.entry-points."functrans.partitioners"]
    save_inputs = "my_package.strategies:save_inputs"
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from functrans.extend import InvalidArgumentError, PluginRegistry, Strategy

__all__ = ["GROUP", "Registered", "examples", "get", "names", "register"]

#: The entry point group installed strategies are discovered in.
GROUP = "functrans.partitioners"


@dataclass(frozen=True)
class Registered:
    """One registered strategy: the callable and the option sets the property suite runs it
    with (read-only; :func:`examples` hands out copies).

    >>> r = Registered(lambda joint: [], examples=(MappingProxyType({"budget": 0.5}),))
    >>> r.examples[0]["budget"]
    0.5
    """

    strategy: Strategy
    examples: tuple[Mapping[str, Any], ...] = (MappingProxyType({}),)


def _adopt(name: str, obj: object) -> object:
    """Register what an entry point names: a strategy callable."""
    if not callable(obj) or isinstance(obj, type):
        raise InvalidArgumentError(
            f"a {GROUP} entry point must name a strategy callable (joint, **options) -> nodes "
            f"to save, or a module that calls functrans.partitioners.register; got {obj!r}"
        )
    return register(name, obj)


_STRATEGIES: PluginRegistry[Registered] = PluginRegistry(
    "partition strategy", package=__name__, group=GROUP, adopt=_adopt, key=lambda r: r.strategy
)


def register(
    name: str,
    strategy: Strategy,
    *,
    aliases: Iterable[str] = (),
    replace: bool = False,
    examples: Sequence[Mapping[str, Any]] = ({},),
) -> Strategy:
    """Register ``strategy`` under ``name`` (and ``aliases``); returns it.

    ``examples`` are option sets the property suite runs the strategy with (strategies with a
    required option, like ``memory_budget``'s budget, list a few). Registering the same callable
    again under its name is allowed; another one needs ``replace=True``.

    >>> from functrans import partitioners
    >>> def keep_inputs(joint, *, keep=1.0):
    ...     return list(joint.primals())
    >>> _ = partitioners.register("keep_inputs", keep_inputs, examples=({"keep": 0.5},))
    >>> partitioners.get("keep_inputs") is keep_inputs, partitioners.examples("keep_inputs")
    (True, ({'keep': 0.5},))
    """
    record = Registered(strategy, tuple(MappingProxyType(dict(e)) for e in examples))
    _STRATEGIES.register(name, record, aliases=aliases, replace=replace)
    return strategy


def examples(name: str) -> tuple[dict[str, Any], ...]:
    """Option sets to exercise the strategy ``name`` with (``({},)`` unless registered).

    >>> from functrans import partitioners
    >>> partitioners.examples("default")
    ({},)
    """
    return tuple(dict(e) for e in _STRATEGIES.get(name).examples)


def get(name: str) -> Strategy:
    """The strategy registered as ``name``; unknown names list the registered ones.

    >>> from functrans import partitioners
    >>> partitioners.get("checkpoint") is partitioners.get("full_remat")
    True
    """
    return _STRATEGIES.get(name).strategy


def names(*, aliases: bool = False) -> list[str]:
    """Names of every registered strategy (and their aliases with ``aliases=True``).

    >>> from functrans import partitioners
    >>> {"default", "min_cut", "full_remat"} <= set(partitioners.names())
    True
    """
    return _STRATEGIES.names(aliases=aliases)
