"""A peak goal planned on the step as it runs: repeated blocks as regions, each call cut its
own way.

``memory_budget(peak_bytes=N)`` and ``min_peak`` state a goal for the whole training step's
peak (a :class:`~functrans.extend.PeakGoal`, declared when they register). Planned on the
unrolled step (every block pasted into one graph), the ILP sees a linear model of that
graph's live bytes; but ``ft.jit`` runs repeated blocks as regions
(:mod:`functrans._jit.outline`), where a block's backward recomputes inside its own call and
frees what it recomputed before the next block's backward starts. Per-block checkpointing
(a region that saves only its inputs) lives there, and the unrolled plan never sees it: on
stacks it refused limits that ``full_remat`` itself measures below. So a step traced with
regions is planned here, on the step the executor runs:

- each region is cut several ways (:data:`CHOICES`, from ``full_remat``: the block saves its
  inputs only, per-block checkpointing, through ``memory_budget`` at fractions of the
  block's own saved bytes and ``min_cut``, to ``default``: it saves all it may), each cut
  once, however many calls use it;
- an assignment gives every block call one of its region's cuts, and cuts the step's own ops
  around the blocks (embedding, head, loss) with ``default`` or ``min_cut``; its peak and its
  recompute are those of the outlined step's :class:`~functrans.Partition`: the liveness
  simulation the measured peaks match (a block call's temporaries read from its region's own
  simulation) and the FLOPs recomputed inside blocks and out;
- every uniform assignment is tried first, so the answer is never worse than any named local
  strategy or per-block checkpointing; from the one that recomputes least within the goal
  (``min_peak``: the lowest peak found, then within that peak), the last calls move to cuts
  that save more: a block's backward runs while the blocks before it hold what they saved,
  so the last blocks' savings cost the peak least (the last block's activations are live
  when the backward starts either way). For each cut, from the one that saves most, a
  bisection finds how many of the last calls still at cheaper cuts can take it within the
  goal: a few dozen simulations of a graph of one op per block.

This is the shape of Rotor's and Checkmate's chain problems (blocks in a chain, per block a
choice of what to keep, a peak that is a running sum over the backward), solved by search over
an exact simulation rather than by a DP over a cost model: every answer is measured the way
it will run, and identical blocks are cut once. A goal no assignment meets (a limit below the
lowest peak found here) falls back to the unrolled step's ILP, which names the lowest peak it
reaches when that fails too.

>>> from functrans._jit.step_plan import CHOICES
>>> [c.label for c in CHOICES]
['full_remat', 'memory_budget(0.25)', 'memory_budget(0.5)', 'min_cut', 'default']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from functrans._core.backends import Backend, capabilities
from functrans._core.graph import JointGraph
from functrans._core.logs import log
from functrans._core.strategies import PeakGoal, registered
from functrans._cut.partition import Partition, Strategy, partition
from functrans._trace.regions import mode as region_mode
from functrans._trace.regions.graph import REGIONS

from .outline import CutOf, Outlined, cut_region, outline, region_calls, uniform

__all__ = [
    "CHOICES",
    "Choice",
    "Outcome",
    "Planned",
    "blockwise",
    "folded",
    "largest_passing",
    "outlined",
    "plan_step",
]


@dataclass(frozen=True)
class Choice:
    """One way to cut a region: a strategy and its options."""

    label: str
    strategy: str
    options: tuple[tuple[str, Any], ...] = ()


#: the cuts each region is offered, from the one that saves least to the one that saves most
CHOICES = (
    Choice("full_remat", "full_remat"),
    Choice("memory_budget(0.25)", "memory_budget", (("budget", 0.25),)),
    Choice("memory_budget(0.5)", "memory_budget", (("budget", 0.5),)),
    Choice("min_cut", "min_cut"),
    Choice("default", "default"),
)

#: how the step's own ops around the blocks may be cut
STEP_CUTS = ("default", "min_cut")


@dataclass(frozen=True)
class Assignment:
    """Per block call (in forward order) the index of its cut in :data:`CHOICES`, and the
    step's own cut."""

    levels: tuple[int, ...]
    step: str


@dataclass(frozen=True)
class Planned:
    """An assignment planned: the outlined step, its partition, its peak and recompute."""

    assignment: Assignment
    joint: JointGraph = field(repr=False)
    partition: Partition = field(repr=False)
    peak: int
    recompute: int

    def describe(self) -> str:
        """Which cut each block call took (runs of equal cuts folded) and the step's cut."""
        blocks = folded([CHOICES[level].label for level in self.assignment.levels])
        return f"blocks: {blocks}; around them: {self.assignment.step}"


def folded(labels: Sequence[str]) -> str:
    """Labels in order, runs of equal ones folded.

    >>> folded(["min_cut", "min_cut", "default"])
    '2 x min_cut, 1 x default'
    """
    runs: list[list[Any]] = []
    for label in labels:
        if runs and runs[-1][0] == label:
            runs[-1][1] += 1
        else:
            runs.append([label, 1])
    return ", ".join(f"{n} x {label}" for label, n in runs)


class Outcome(NamedTuple):
    """What planning found: the plan (None: none meets the goal) and the lowest peak of the
    uniform assignments, the floor block-by-block planning reached."""

    planned: Planned | None
    lowest: Planned
    goal: PeakGoal

    def best(
        self, unrolled: Callable[[], JointGraph], strategy: str, options: dict[str, Any]
    ) -> Partition:
        """The planned partition; for a goal of the lowest peak (``min_peak``), the unrolled
        step's plan where it is lower (its ILP cuts inside blocks, per op, which the five
        cuts of a region may miss: ViT's floor is 0.242 of eager's unrolled, 0.272 here)."""
        assert self.planned is not None
        p = self.planned.partition
        if self.goal.limit is not None:
            return p
        other = partition(unrolled(), strategy, **options)
        return other if other.peak_bytes < p.peak_bytes else p

    def why(self) -> str:
        """Why no plan was given, for an error that the unrolled step's ILP raises next."""
        return (
            "Planned block by block (repeated blocks as regions, as the step runs), the lowest "
            f"step peak found is {self.lowest.peak} bytes ({self.lowest.describe()}): ask for "
            "at least the lesser of the two"
        )


class _Planner:
    """Evaluates assignments of one traced step (each region cut each way once)."""

    def __init__(self, jg: JointGraph, backend: Backend, hands_over: bool) -> None:
        self.jg, self.backend, self.hands_over = jg, backend, hands_over
        self.calls = region_calls(jg)
        self.cuts: dict[tuple[int, int], Outlined] = {}
        self.seen: dict[Assignment, Planned] = {}

    def cut(self, key: int, level: int) -> Outlined:
        if (key, level) not in self.cuts:
            region = self.jg.attached(REGIONS)[key]
            assert region is not None, "a region op without its region"
            choice = CHOICES[level]
            self.cuts[key, level] = cut_region(
                region, choice.strategy, dict(choice.options), self.backend
            )
        return self.cuts[key, level]

    def evaluate(self, a: Assignment) -> Planned:
        if a not in self.seen:
            level_of = {call: level for (_, call), level in zip(self.calls, a.levels, strict=True)}
            cut_of: CutOf = lambda key, call: self.cut(key, level_of[call])  # noqa: E731
            outlined = outline(self.jg, cut_of, self.hands_over)
            p = partition(outlined, a.step)
            self.seen[a] = Planned(a, outlined, p, p.peak_bytes, p.recompute_flops)
        return self.seen[a]


def goal_of(strategy: str | Strategy, options: dict[str, Any]) -> PeakGoal | None:
    """What ``strategy`` with ``options`` asks of the step's peak (None: no goal; a strategy
    object, not a registered name, declares none)."""
    if not isinstance(strategy, str):
        return None
    goal = registered(strategy).peak_goal
    return None if goal is None else goal(options)


def blockwise(strategy: str | Strategy, options: dict[str, Any]) -> bool:
    """Whether a training step cut with ``strategy`` keeps its repeated blocks as regions
    (:mod:`functrans._jit.outline`): regions compiled (the default) and a strategy that cuts
    a block by itself (registered ``local``) or states a peak goal, planned here."""
    if region_mode() != "compiled" or not isinstance(strategy, str):
        return False
    return registered(strategy).local or goal_of(strategy, options) is not None


def outlined(
    jg: JointGraph, strategy: str | Strategy, options: dict[str, Any], backend: Backend
) -> JointGraph | Outcome:
    """``jg`` (traced with its regions kept) with its block calls outlined, each region cut
    by ``strategy``; or, where the options state a peak goal, the block-by-block plan's
    outcome (:func:`plan_step`)."""
    hands_over = capabilities(backend).hands_over
    goal = goal_of(strategy, options)
    if goal is None:
        return outline(jg, uniform(jg, strategy, options, backend), hands_over)
    assert isinstance(strategy, str)
    return plan_step(jg, goal, strategy, backend, hands_over)


def plan_step(
    jg: JointGraph,
    goal: PeakGoal,
    name: str,
    backend: Backend,
    hands_over: bool,
    levels: Sequence[int] | None = None,
    around: Sequence[str] = STEP_CUTS,
) -> Outcome:
    """The assignment of cuts to ``jg``'s block calls that recomputes least within ``goal``
    (see the module docstring), its partition named ``name``; ``levels``: the cuts of
    :data:`CHOICES` (their indices) a block may take (all of them unless given); ``around``:
    the cuts the step's own ops around the blocks may take."""
    planner = _Planner(jg, backend, hands_over)
    n = len(planner.calls)
    offered = tuple(range(len(CHOICES)) if levels is None else sorted(levels))
    uniform = [
        planner.evaluate(Assignment((level,) * n, step)) for step in around for level in offered
    ]
    limit = min(u.peak for u in uniform) if goal.limit is None else goal.limit
    within = [u for u in uniform if u.peak <= limit]
    lowest = min(uniform, key=lambda u: (u.peak, u.recompute))
    if not within:
        return Outcome(None, lowest, goal)
    best = min(within, key=lambda u: (u.recompute, u.peak))
    best = _staircase(planner, best, limit, offered)
    log(
        "partition",
        f"{name}: planned block by block",
        lambda: f"peak {best.peak}: {best.describe()}",
    )
    p = dataclasses.replace(best.partition, strategy=name)
    return Outcome(dataclasses.replace(best, partition=p), lowest, goal)


def _staircase(planner: _Planner, start: Planned, limit: int, offered: Sequence[int]) -> Planned:
    """``start`` with its last calls moved to cuts that save more, as many as stay within
    ``limit``: for each cut from the one that saves most, a bisection on how many of the last
    calls still below it take it."""
    best = start
    levels = list(start.assignment.levels)
    for level in reversed(offered):
        below = [i for i, lv in enumerate(levels) if lv < level]  # calls that may move up
        if not below:
            continue

        def moved(
            m: int,
            below: Sequence[int] = below,
            level: int = level,
            now: tuple[int, ...] = tuple(levels),
        ) -> Planned:
            trial = list(now)
            for i in below[len(below) - m :]:
                trial[i] = level
            return planner.evaluate(Assignment(tuple(trial), start.assignment.step))

        fits = largest_passing(len(below), lambda m: moved(m).peak <= limit)
        if fits == 0:
            continue
        found = moved(fits)
        if found.recompute <= best.recompute:
            best, levels = found, list(found.assignment.levels)
    return best


def largest_passing(n: int, ok: Callable[[int], bool]) -> int:
    """The largest ``m`` in ``0..n`` with ``ok(m)``, by bisection (``ok(0)`` is taken to hold
    and ``ok`` to fall once as ``m`` grows).

    >>> largest_passing(10, lambda m: m <= 7), largest_passing(4, lambda m: m == 0)
    (7, 0)
    """
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
