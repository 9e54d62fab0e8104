"""``"min_peak"``: the lowest step peak the peak planner reaches, then the least recompute.

Where ``memory_budget(peak_bytes=N)`` spends as little recompute as fits ``N``, ``min_peak``
asks for as little memory as the step can run in: the peak model of :mod:`._peak` minimised
first, the recompute cost at that peak second, the answer checked by simulation. It is the
low end of ``ft.pareto(jg, by="peak")`` and the figure ``memory_budget`` names when a
``peak_bytes`` is below it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch.fx as fx

from functrans.extend import (
    Cut,
    JointGraph,
    PeakGoal,
    check_number,
    check_option,
    cut_problem,
    parse_options,
)

from . import register
from ._plan_peak import lowest_peak

__all__ = ["MinPeak", "min_peak"]


@dataclass(frozen=True)
class MinPeak:
    """Options of ``min_peak``: ``cost`` (``"flops"`` or a callable ``node -> cost``) and the
    ILP's ``time_limit`` in seconds.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x, w: torch.tanh(x @ w).sum())(torch.ones(64, 64), torch.ones(64, 64))
    >>> low = ft.partition(jg, MinPeak())
    >>> low.peak_bytes <= ft.partition(jg, "default").peak_bytes
    True
    """

    cost: str | Callable[[fx.Node], float] = "flops"
    time_limit: float = 20.0

    def __post_init__(self) -> None:
        ok = callable(self.cost) or self.cost == "flops"
        check_option("min_peak", "cost", self.cost, ok, "'flops' or a callable node -> cost")
        check_number("min_peak", "time_limit", self.time_limit, above=0, allow_inf=True)

    @property
    def __name__(self) -> str:  # shown as the partition's strategy name
        return "min_peak"

    def __call__(self, joint: JointGraph) -> Cut:
        problem = cut_problem(joint)
        costs = problem.costs(None if isinstance(self.cost, str) else self.cost)
        return lowest_peak(joint, costs, time_limit=self.time_limit).cut


def min_peak(joint: JointGraph, **options: object) -> Cut:
    """The ``"min_peak"`` strategy: ``partition(jg, "min_peak")`` (options: ``cost``,
    ``time_limit``)."""
    return _options(options)(joint)


def _options(options: Mapping[str, object]) -> MinPeak:
    """``min_peak``'s options from ``partition``'s keywords (its declared option check).

    >>> _options({"time_limit": 5.0})
    MinPeak(cost='flops', time_limit=5.0)
    """
    return parse_options(MinPeak, "min_peak", options)


def _peak_goal(options: Mapping[str, object]) -> PeakGoal:
    """The lowest step peak, whatever the options (they tune the unrolled step's ILP)."""
    return PeakGoal(limit=None)


register("min_peak", min_peak, check_options=_options, peak_goal=_peak_goal)
