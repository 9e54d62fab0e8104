"""The registry of partition strategies, owned by the core: ``functrans.partitioners`` fills it.

The core looks strategies up here by name and never imports the plugin package: the registry
names the package as data and imports its public modules on first use
(:mod:`functrans._core.plugins`). The plugin package re-exports these functions under its own
names (``register``, ``get``, ``names``, ``examples``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .errors import InvalidArgumentError
from .plugins import PluginRegistry

#: What the registry holds: ``(joint, **options) -> saved nodes`` (typed precisely as
#: :data:`functrans.extend.Strategy`, which the cut layer defines).
Strategy = Callable[..., Any]

#: A strategy's declared option check, ``check(options)``: raises
#: :class:`~functrans.InvalidArgumentError` for an option name the strategy does not take or a
#: value it does not accept, as the strategy itself would when it runs (its result is ignored).
#: ``jit`` and ``grad`` run it when they are made, ``vjp`` and ``partition`` before they trace
#: or run the strategy, so bad options never wait for a training step. The usual one builds
#: the strategy's frozen options dataclass: ``lambda options: parse_options(MyOptions, "mine",
#: options)``.
OptionsCheck = Callable[[Mapping[str, Any]], object]

__all__ = [
    "STRATEGY_GROUP",
    "OptionsCheck",
    "PeakGoal",
    "PeakGoalOf",
    "RegisteredStrategy",
    "check_strategy_options",
    "register_strategy",
    "registered",
    "registered_strategy",
    "strategy_examples",
    "strategy_names",
]

#: The entry point group installed strategies are discovered in.
STRATEGY_GROUP = "functrans.partitioners"


@dataclass(frozen=True)
class PeakGoal:
    """What a strategy asks of a whole training step: a peak of at most ``limit`` bytes (None:
    the lowest peak found), then the least recompute. A strategy that declares one
    (``peak_goal=`` of :func:`register_strategy`) lets ``ft.jit`` plan the step as it runs,
    repeated blocks as regions each cut its own way (:mod:`functrans._jit.step_plan`), rather
    than only the unrolled step's graph.

    >>> PeakGoal(limit=2**20)
    PeakGoal(limit=1048576)
    """

    limit: int | None


#: A strategy's declared step goal for a set of options: the :class:`PeakGoal` they state,
#: or None where they state none (``memory_budget`` with ``budget=`` bounds the saved bytes,
#: not the peak).
PeakGoalOf = Callable[[Mapping[str, Any]], PeakGoal | None]


@dataclass(frozen=True)
class RegisteredStrategy:
    """One registered strategy: the callable, the option sets the property suite runs it with
    (read-only; :func:`examples` hands out copies) and the check of its options it declared
    (:data:`OptionsCheck`; None: its signature says which options it takes, no more).
    ``local``: its cut of a block depends on that block alone (``default``, ``min_cut``,
    ``full_remat``), so ``ft.jit`` cuts a repeated block once and reuses that cut for every
    call; ``peak_goal``: what its options ask of the step's peak (:data:`PeakGoalOf`).

    >>> r = RegisteredStrategy(lambda joint: [], examples=(MappingProxyType({"budget": 0.5}),))
    >>> r.examples[0]["budget"], r.check_options
    (0.5, None)
    """

    strategy: Strategy
    examples: tuple[Mapping[str, Any], ...] = (MappingProxyType({}),)
    check_options: OptionsCheck | None = None
    local: bool = False
    peak_goal: PeakGoalOf | None = None


def _adopt(name: str, obj: object) -> object:
    """Register what an entry point names: a strategy callable."""
    if not callable(obj) or isinstance(obj, type):
        raise InvalidArgumentError(
            f"a {STRATEGY_GROUP} entry point must name a strategy callable (joint, **options) "
            f"-> nodes to save, or a module that calls functrans.partitioners.register; got {obj!r}"
        )
    return register_strategy(name, obj)


_STRATEGIES: PluginRegistry[RegisteredStrategy] = PluginRegistry(
    "partition strategy",
    package="functrans.partitioners",
    group=STRATEGY_GROUP,
    adopt=_adopt,
    key=lambda r: r.strategy,
)


def register_strategy(
    name: str,
    strategy: Strategy,
    *,
    aliases: Iterable[str] = (),
    replace: bool = False,
    examples: Sequence[Mapping[str, Any]] = ({},),
    check_options: OptionsCheck | None = None,
    local: bool = False,
    peak_goal: PeakGoalOf | None = None,
) -> Strategy:
    """Register ``strategy`` under ``name`` (and ``aliases``); returns it.

    ``examples`` are option sets the property suite runs the strategy with (strategies with a
    required option, like ``memory_budget``'s budget, list a few). ``check_options`` declares
    how the strategy checks its options (:data:`OptionsCheck`): a strategy that takes
    ``**options`` needs one for a misspelt name or a bad value to raise when ``jit(f,
    partition=name, ...)`` is made rather than at its first training step. Registering the same
    callable again under its name is allowed; another one needs ``replace=True``. ``local``
    declares that its cut of a block depends on that block alone, ``peak_goal`` what its
    options ask of the step's peak (see :class:`RegisteredStrategy`): both let ``ft.jit`` plan
    a step of repeated blocks block by block.

    >>> from functrans import partitioners
    >>> def keep_inputs(joint, *, keep=1.0):
    ...     return list(joint.primals())
    >>> _ = partitioners.register("keep_inputs", keep_inputs, examples=({"keep": 0.5},))
    >>> partitioners.get("keep_inputs") is keep_inputs, partitioners.examples("keep_inputs")
    (True, ({'keep': 0.5},))
    """
    frozen = tuple(MappingProxyType(dict(e)) for e in examples)
    record = RegisteredStrategy(strategy, frozen, check_options, local, peak_goal)
    _STRATEGIES.register(name, record, aliases=aliases, replace=replace)
    return strategy


def strategy_examples(name: str) -> tuple[dict[str, Any], ...]:
    """Option sets to exercise the strategy ``name`` with (``({},)`` unless registered).

    >>> from functrans import partitioners
    >>> partitioners.examples("default")
    ({},)
    """
    return tuple(dict(e) for e in _STRATEGIES.get(name).examples)


def check_strategy_options(name: str, options: Mapping[str, Any]) -> None:
    """Run the option check the strategy registered as ``name`` declared (see
    :func:`register_strategy`); a strategy that declared none is not checked here. An unknown
    name lists the registered ones.

    >>> from functrans.extend import check_strategy_options
    >>> check_strategy_options("memory_budget", {"budget": 0.5})
    >>> check_strategy_options("memory_budget", {"budget": -1})
    Traceback (most recent call last):
    ...
    functrans._core.errors.InvalidArgumentError: memory_budget: budget=-1 (int) is not accepted; ...
    """
    check = _STRATEGIES.get(name).check_options
    if check is not None:
        check(options)


def registered(name: str) -> RegisteredStrategy:
    """The registration of ``name``: the strategy and what it declared.

    >>> from functrans import partitioners
    >>> registered("min_cut").local, registered("memory_budget").local
    (True, False)
    """
    return _STRATEGIES.get(name)


def registered_strategy(name: str) -> Strategy:
    """The strategy registered as ``name``; unknown names list the registered ones.

    >>> from functrans import partitioners
    >>> partitioners.get("checkpoint") is partitioners.get("full_remat")
    True
    """
    return _STRATEGIES.get(name).strategy


def strategy_names(*, aliases: bool = False) -> list[str]:
    """Names of every registered strategy (and their aliases with ``aliases=True``).

    >>> from functrans import partitioners
    >>> {"default", "min_cut", "full_remat"} <= set(partitioners.names())
    True
    """
    return _STRATEGIES.names(aliases=aliases)
