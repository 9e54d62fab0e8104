"""``memory_budget(peak_bytes=N)``: the least recompute whose step peak stays within ``N``.

The ILP (:mod:`._ilp`) bounds the step's peak as :mod:`._peak` models it; every answer is then
checked the way it will run: the cut is applied (:func:`functrans.extend.apply_cut`) and its
forward and backward graphs simulated (:attr:`~functrans.Partition.peak_bytes`, the figure a
profile of the step measures). Where the model was short of the simulation, the ILP runs again
with the limit lowered by the difference; where it left room (the model is mostly above the
simulation, as its bounds are), again with the limit raised by the room, keeping the cheapest
answer whose simulated peak fits. A limit below the lowest peak found (the ILP minimising the
modelled peak first) is an :class:`~functrans.extend.InvalidPartitionError` naming it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx as fx

from functrans.extend import (
    Cut,
    CutProblem,
    InvalidPartitionError,
    JointGraph,
    apply_cut,
    cut_problem,
)

from ._ilp import IlpResult, OffloadTerms, PeakTerms, solve_ilp
from ._peak import PeakModel, peak_model
from .default import default
from .full_remat import full_remat
from .min_cut import min_cut

__all__ = ["Planned", "lowest_peak", "plan_peak"]

#: ILP solves spent moving the model's limit towards the simulated peak (each side)
_ROUNDS = 3


@dataclass(frozen=True)
class Planned:
    """One checked answer: the cut, its simulated peak, its recompute cost and the peak the
    model gave it."""

    cut: Cut
    peak: int
    cost: float
    model_peak: float


def plan_peak(
    joint: JointGraph,
    peak_bytes: int,
    costs: Sequence[float],
    *,
    max_bytes: float = math.inf,
    time_limit: float = 20.0,
    offload: OffloadTerms | None = None,
) -> Cut:
    """The cheapest cut found whose simulated step peak is at most ``peak_bytes`` (and whose
    activation bytes are at most ``max_bytes``); ``costs`` are the values' recompute costs."""
    problem = cut_problem(joint)
    model = peak_model(problem)
    others = _baselines(problem, costs, max_bytes, offload)  # simulated once, used twice
    best: Planned | None = None
    limit = float(peak_bytes)
    for _ in range(_ROUNDS):  # the model short of the simulation: lower the limit
        found = _attempt(problem, model, costs, limit, max_bytes, time_limit, offload)
        if found is None:
            break
        if found.peak <= peak_bytes:
            best = found
            break
        limit -= found.peak - peak_bytes
    if best is None:  # the model's lowest peak may still simulate within the limit
        lowest = _lowest(problem, model, costs, max_bytes, time_limit, offload, others)
        if lowest.peak > peak_bytes:
            raise InvalidPartitionError(
                f"memory_budget: peak_bytes={peak_bytes} is below the lowest step peak found, "
                f"{lowest.peak} bytes (forward then backward, above the inputs; recompute cost "
                f"{lowest.cost:.3g}); ask for at least that"
            )
        best, limit = lowest, lowest.model_peak
    for _ in range(_ROUNDS):  # room left: raise the limit while it buys less recompute
        room = peak_bytes - best.peak
        if room <= 0.001 * peak_bytes:
            break
        limit += room
        found = _attempt(problem, model, costs, limit, max_bytes, time_limit, offload)
        if found is None or found.peak > peak_bytes or found.cost >= best.cost:
            break
        best = found
    for other in others:  # cheaper and within N?
        if other.peak <= peak_bytes and other.cost < best.cost:
            best = other
    return best.cut


def _baselines(
    problem: CutProblem, costs: Sequence[float], max_bytes: float, offload: OffloadTerms | None
) -> list[Planned]:
    """``full_remat``'s, ``default``'s and ``min_cut``'s cuts, simulated, those within
    ``max_bytes`` activation bytes: where the model is loose (or its ILP finds no set at a
    tight ``max_bytes`` that ``full_remat`` meets) they can be the answer (with offload, they
    are not compared)."""
    if offload is not None:
        return []
    out = []
    for strategy in (full_remat, default, min_cut):
        cut = Cut(saved=tuple(strategy(problem.joint)))
        p = apply_cut(problem.joint, cut)
        if p.activation_bytes > max_bytes:
            continue
        spent = sum(costs[problem.index[n]] for n in p.recomputed if n in problem.index)
        out.append(Planned(cut, p.peak_bytes, float(spent), math.inf))
    return out


def lowest_peak(
    joint: JointGraph,
    costs: Sequence[float],
    *,
    max_bytes: float = math.inf,
    time_limit: float = 20.0,
    offload: OffloadTerms | None = None,
) -> Planned:
    """The cut of the lowest modelled step peak (then the least recompute at it), checked.

    >>> import torch, functrans as ft
    >>> from functrans.extend import cut_problem
    >>> jg = ft.joint(lambda x, w: torch.tanh(x @ w).sum())(torch.ones(8, 8), torch.ones(8, 8))
    >>> low = lowest_peak(jg, cut_problem(jg).costs())
    >>> low.peak <= ft.partition(jg, "default").peak_bytes
    True
    """
    problem = cut_problem(joint)
    others = _baselines(problem, costs, max_bytes, offload)
    return _lowest(problem, peak_model(problem), costs, max_bytes, time_limit, offload, others)


def _lowest(
    problem: CutProblem,
    model: PeakModel,
    costs: Sequence[float],
    max_bytes: float,
    time_limit: float,
    offload: OffloadTerms | None,
    others: Sequence[Planned],
) -> Planned:
    """The lowest modelled peak's cut, or of ``others`` (the named cuts, simulated) one that
    simulates lower."""
    terms = PeakTerms(model, math.inf, first=True)
    result = solve_ilp(problem, costs, max_bytes, time_limit, offload, terms)
    if result is None:
        if not others:
            raise InvalidPartitionError(
                f"memory_budget: no saved set fits max_bytes={max_bytes:.0f} activation bytes"
            )
        # the peak model's ILP can miss a set that a named cut meets (max_bytes=0 where
        # full_remat saves only inputs): the lowest of those is the lowest found
        return min(others, key=lambda o: (o.peak, o.cost))
    found = _checked(problem, result)
    # the model bounds the peak, loosely where recomputation is pulled in many small pieces
    # (a graph of a few scalars, a tiny HF model's shared masks): where another strategy's
    # cut simulates lower, that is the lowest peak found
    for other in others:
        if other.peak < found.peak:
            found = dataclasses.replace(other, model_peak=found.model_peak)
    return found


def _attempt(
    problem: CutProblem,
    model: PeakModel,
    costs: Sequence[float],
    limit: float,
    max_bytes: float,
    time_limit: float,
    offload: OffloadTerms | None,
) -> Planned | None:
    result = solve_ilp(problem, costs, max_bytes, time_limit, offload, PeakTerms(model, limit))
    return None if result is None else _checked(problem, result)


def _checked(problem: CutProblem, result: IlpResult) -> Planned:
    cut = Cut(
        saved=tuple(_nodes(problem, result.saved)),
        offloaded=tuple(_nodes(problem, result.offloaded)),
    )
    modelled = result.peak if result.peak is not None else math.inf
    return Planned(cut, apply_cut(problem.joint, cut).peak_bytes, result.cost, modelled)


def _nodes(problem: CutProblem, indices: Sequence[int]) -> list[fx.Node]:
    return [problem[i].node for i in indices]
