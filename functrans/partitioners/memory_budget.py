"""``"memory_budget"`` and ``"optimal"``: the least recompute that fits a memory limit.

Two limits, which differ. ``budget``/``max_bytes`` bound the bytes that cross from forward to
backward (the saved values); ``peak_bytes`` bounds the step's peak, the figure a user measures
(:attr:`~functrans.Partition.peak_bytes`: forward then backward, above the inputs). A small cut
need not mean a low peak: saving only the inputs recomputes the whole forward at the first
backward step and holds it there. ``peak_bytes`` is planned by :mod:`._plan_peak` (an ILP over a
linear model of the step's live bytes, answers checked by simulation); it combines with
``max_bytes``/``budget`` (both hold) and with ``offload``. The lowest peak it reaches is the
``"min_peak"`` strategy's.

``budget`` is a fraction on torch's scale: 1.0 is ``min_cut``'s activation bytes, 0.0 is
``full_remat``'s, linear in between. Any finite number >= 0 is accepted: above 1.0 the budget
goes on growing at the same rate, and the ILP saves more than ``min_cut`` to recompute less,
down to no recompute at all once ``default``'s bytes fit (the greedy solver only evicts from
``min_cut``'s set, so for it budgets above 1.0 act as 1.0). ``max_bytes`` gives the budget in
bytes instead (an int >= 0). ``solver="ilp"`` solves the exact 0/1 program with HiGHS;
``"greedy"`` evicts saved values from ``min_cut``'s set by bytes freed per unit of recompute
cost (fast on huge graphs, no optimality guarantee). ``cost`` is ``"flops"`` or a callable
``node -> cost`` (e.g. a measured runtime model).

With symbolic sizes (``jit(f, dynamic=...)``, ``joint(f, dynamic=...)``) bytes are taken at
the trace's example sizes, and a budget met there can be exceeded far from them (a budget met
at seq 32 is 128x over at seq 4096). ``at={"batch": 64, "seq": 4096}`` plans at those sizes
instead: the names ``dynamic=`` gave the dimensions (or ``x.shape[1]`` for an unnamed one), so
``max_bytes`` (or the fraction) holds at the largest size you declare, and below it too, since
every saved value's bytes grow with the sizes.

``offload=Offload(bandwidth=..., host_bytes=...)`` adds a third choice per value: keep it in
host memory between the passes (copied out after its last forward use, back before its first
backward use). The ILP then minimises recompute cost plus the copy time compute cannot hide
(see :class:`~functrans.Offload`), and budgets below ``full_remat``'s bytes become feasible
(random masks and other values that may not be recomputed can wait in host memory).
``Offload(bandwidth=0)`` is exactly the plain ``memory_budget``; with unlimited bandwidth nothing
offloadable is recomputed. Offload needs ``solver="ilp"``.

``"optimal"`` is ``memory_budget`` with the ILP and a required ``budget``: the name to use when
you want the exact answer and want to say so.

Unknown options and bad values raise ``InvalidArgumentError`` naming the option, the value and
what is accepted.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch.fx as fx

from functrans.extend import (
    Cut,
    CutProblem,
    InvalidArgumentError,
    InvalidPartitionError,
    JointGraph,
    Offload,
    PeakGoal,
    activation_bytes,
    check_names,
    check_number,
    check_option,
    cut_problem,
    flops,
    parse_options,
    sizes_at,
    split,
)

from . import register
from ._ilp import OffloadTerms, solve_ilp
from ._plan_peak import plan_peak
from .full_remat import full_remat
from .min_cut import min_cut

__all__ = ["MemoryBudget", "memory_budget", "optimal"]


@dataclass(frozen=True)
class MemoryBudget:
    """A configured budget strategy: ``partition(jg, MemoryBudget(budget=0.3))``.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x, w: torch.tanh(x @ w).sum())(torch.ones(8, 8), torch.ones(8, 8))
    >>> p = ft.partition(jg, MemoryBudget(budget=0.0))
    >>> p.activation_bytes, p.recomputed
    (0, (mm, tanh))
    """

    budget: float | None = None
    max_bytes: int | None = None
    #: the step's peak memory (forward then backward, above the inputs: the figure of
    #: :attr:`~functrans.Partition.peak_bytes` and of ``functrans.testing.measure_peak``)
    peak_bytes: int | None = None
    solver: str = "ilp"
    cost: str | Callable[[fx.Node], float] = "flops"
    time_limit: float = 20.0
    #: the sizes to plan at, by dimension name (symbolic traces only); kept as sorted pairs
    at: Mapping[str, int] | tuple[tuple[str, int], ...] | None = None
    #: a third choice per value: host memory between the passes (None: save or recompute)
    offload: Offload | None = None

    def __post_init__(self) -> None:
        _check_values("memory_budget", {f.name: getattr(self, f.name) for f in fields(self)})
        if isinstance(self.at, Mapping):
            object.__setattr__(self, "at", tuple(sorted(self.at.items())))

    @property
    def __name__(self) -> str:  # shown as the partition's strategy name
        return "memory_budget"

    def limit(self, joint: JointGraph) -> tuple[float, int]:
        """(budget in activation bytes, ``math.inf`` for none; smallest achievable activation
        bytes).

        The smallest is the lesser of ``full_remat``'s and ``min_cut``'s: recomputing all it
        may is not always least, a MUST_SAVE value backward only reads through a smaller
        product (layer norm's ``rstd`` through ``rstd / N``) need not be saved itself, and
        ``min_cut`` saves the product instead.
        """
        low = _activation(joint, full_remat(joint))
        if self.max_bytes is None and self.budget is None:
            return math.inf, low
        high = _activation(joint, min_cut(joint))
        low = min(low, high)
        if self.max_bytes is not None:
            return self.max_bytes, low
        assert self.budget is not None
        return int(low + self.budget * (high - low)), low

    def __call__(self, joint: JointGraph) -> list[fx.Node] | Cut:
        primals = [n.meta.get("val") for n in joint.primals()]
        with sizes_at(primals, dict(self.at or ())):
            return self._solve(joint)

    def _solve(self, joint: JointGraph) -> list[fx.Node] | Cut:
        max_bytes, low = self.limit(joint)
        if self.peak_bytes is not None:
            return self._with_peak(joint, self.peak_bytes, max_bytes)
        if self.offload is not None and self.offload.enabled:
            return self._with_offload(joint, max_bytes, low, self.offload)
        below = max_bytes < low
        if below and self.solver == "greedy":
            raise InvalidPartitionError(_below(max_bytes, low))
        problem = cut_problem(joint)
        costs = problem.costs(None if isinstance(self.cost, str) else self.cost)
        if self.solver == "greedy":
            return greedy(problem, costs, int(max_bytes))
        result = solve_ilp(problem, costs, max_bytes, self.time_limit)
        if result is None and below:  # the ILP may beat both known cuts; here it did not
            raise InvalidPartitionError(_below(max_bytes, low))
        if result is None:  # a feasible set exists (>= low), so the time limit struck first
            warnings.warn(
                f"memory_budget: the ILP found no saved set within its time limit "
                f"({self.time_limit:g} s); falling back to full rematerialization",
                stacklevel=3,
            )
            return full_remat(joint)
        return [problem[i].node for i in result.saved]

    def _with_peak(self, joint: JointGraph, peak: int, max_bytes: float) -> Cut:
        problem = cut_problem(joint)
        costs = problem.costs(None if isinstance(self.cost, str) else self.cost)
        terms = None
        if self.offload is not None and self.offload.enabled:
            terms = offload_terms(joint, problem, costs, self.offload, self.cost)
        return plan_peak(
            joint, peak, costs, max_bytes=max_bytes, time_limit=self.time_limit, offload=terms
        )

    def _with_offload(self, joint: JointGraph, max_bytes: float, low: int, offload: Offload) -> Cut:
        problem = cut_problem(joint)
        costs = problem.costs(None if isinstance(self.cost, str) else self.cost)
        terms = offload_terms(joint, problem, costs, offload, self.cost)
        result = solve_ilp(problem, costs, max_bytes, self.time_limit, terms)
        if result is None:
            if max_bytes < low:
                raise InvalidPartitionError(
                    _infeasible(problem, costs, max_bytes, low, terms, self)
                )
            warnings.warn(
                f"memory_budget: the ILP found no saved set within its time limit "
                f"({self.time_limit:g} s); falling back to full rematerialization",
                stacklevel=3,
            )
            return Cut(saved=tuple(full_remat(joint)))
        return Cut(
            saved=tuple(problem[i].node for i in result.saved),
            offloaded=tuple(problem[i].node for i in result.offloaded),
        )


def _infeasible(
    problem: CutProblem,
    costs: Sequence[float],
    max_bytes: float,
    low: int,
    terms: OffloadTerms,
    options: MemoryBudget,
) -> str:
    """Why no saved set fits ``max_bytes`` with offload: the host limit, or the device."""
    offload = options.offload
    if math.isfinite(terms.host_bytes):
        free = dataclasses.replace(terms, host_bytes=math.inf)
        relaxed = solve_ilp(problem, costs, max_bytes, options.time_limit, free)
        if relaxed is not None:
            needed = sum(problem[i].bytes for i in relaxed.offloaded)
            return (
                f"memory_budget: {max_bytes} device bytes needs more host memory than "
                f"host_bytes={terms.host_bytes:.0f} of offload={offload}: with no host limit it "
                f"offloads {needed} bytes (full_remat keeps {low} bytes on the device)"
            )
    return (
        f"memory_budget: {max_bytes} activation bytes is below what must stay on the device "
        f"even with offload={offload} (values that may be neither recomputed nor offloaded: "
        f"outputs' storage, views, multi-output parts); full_remat keeps {low} bytes"
    )


def offload_terms(
    joint: JointGraph,
    problem: CutProblem,
    costs: Sequence[float],
    offload: Offload,
    cost: str | Callable[[fx.Node], float],
) -> OffloadTerms:
    """The ILP's offload terms: copies out hide behind the forward's compute, copies back
    behind the backward's, ``overlap`` of each, at ``bandwidth``; an exposed byte costs the
    compute it delays."""
    price_of = flops if isinstance(cost, str) else cost
    backward = sum(float(price_of(n)) for n in joint.backward_nodes() if n.op == "call_function")
    forward = sum(costs)
    seconds = offload.seconds(1.0)  # per byte
    if seconds == 0:
        hidden_f = hidden_b = math.inf
    else:
        hidden_f = offload.overlap * forward / offload.compute_rate / seconds
        hidden_b = offload.overlap * backward / offload.compute_rate / seconds
    host = math.inf if offload.host_bytes is None else float(offload.host_bytes)
    return OffloadTerms(
        allowed=[v.can_offload for v in problem],
        host_bytes=host,
        hidden_forward=hidden_f,
        hidden_backward=hidden_b,
        price=seconds * offload.compute_rate,
    )


_BUDGET = (
    "a fraction: 0.0 = full_remat's activation bytes, 1.0 = min_cut's, above 1.0 saves more "
    "than min_cut to recompute less"
)


def _check_values(where: str, options: Mapping[str, Any]) -> None:
    """Check the values of ``MemoryBudget``'s options (absent ones take their defaults)."""
    budget, max_bytes = options.get("budget"), options.get("max_bytes")
    peak = options.get("peak_bytes")
    if budget is not None and max_bytes is not None:
        raise InvalidArgumentError(
            f"{where} takes one of budget= ({_BUDGET}) or max_bytes= (activation bytes), not "
            f"both; got budget={budget!r}, max_bytes={max_bytes!r}"
        )
    if budget is None and max_bytes is None and peak is None:
        raise InvalidArgumentError(
            f"{where} needs a limit: budget= ({_BUDGET}), max_bytes= (activation bytes across "
            "the cut) or peak_bytes= (the step's peak memory above its inputs); got none"
        )
    if peak is not None:
        check_number(where, "peak_bytes", peak, at_least=0, integer=True, meaning="bytes")
    if budget is not None:
        check_number(where, "budget", budget, at_least=0, meaning=_BUDGET)
    if max_bytes is not None:
        check_number(where, "max_bytes", max_bytes, at_least=0, integer=True, meaning="bytes")
    solver, cost = options.get("solver", "ilp"), options.get("cost", "flops")
    ok = isinstance(solver, str) and solver in ("ilp", "greedy")
    check_option(where, "solver", solver, ok, "'ilp' or 'greedy'")
    ok = callable(cost) or (isinstance(cost, str) and cost == "flops")
    check_option(where, "cost", cost, ok, "'flops' or a callable node -> cost")
    time_limit = options.get("time_limit", 20.0)
    check_number(where, "time_limit", time_limit, above=0, allow_inf=True, meaning="seconds")
    at = options.get("at")
    ok = at is None or (
        isinstance(at, Mapping | tuple)
        and all(
            isinstance(k, str) and type(v) is int and v >= 0
            for k, v in (at.items() if isinstance(at, Mapping) else at)
        )
    )
    check_option(where, "at", at, ok, "a mapping {dimension name: size >= 0}")
    offload = options.get("offload")
    accepted = "an Offload(bandwidth=..., host_bytes=...) or None"
    check_option(
        where, "offload", offload, offload is None or isinstance(offload, Offload), accepted
    )
    if peak is not None and solver != "ilp":
        raise InvalidArgumentError(
            f"{where}: peak_bytes={peak} needs solver='ilp'; got solver={solver!r} (the greedy "
            "solver bounds only the bytes across the cut)"
        )
    if offload is not None and solver != "ilp":
        raise InvalidArgumentError(
            f"{where}: offload={offload} needs solver='ilp'; got solver={solver!r} (the greedy "
            "solver only saves or recomputes)"
        )


def _below(max_bytes: float, low: int) -> str:
    return (
        f"memory_budget: {max_bytes} activation bytes is below the smallest achievable "
        f"{low} bytes (random-op outputs and MUST_SAVE values must be saved)"
    )


def _activation(joint: JointGraph, saved: list[fx.Node]) -> int:
    return sum(activation_bytes(n) for n in split(joint, saved).saved)


def greedy(p: CutProblem, costs: Sequence[float], max_bytes: int) -> list[fx.Node]:
    """Start from ``min_cut``'s saved set; evict the values that free the most bytes per unit
    of recompute cost (``costs``) until the rest fits ``max_bytes``."""
    joint = p.joint
    saved = {p.index[n] for n in split(joint, min_cut(joint)).saved}
    used = sum(p[i].bytes for i in saved)
    recomputed: set[int] = set()

    def closure(v: int) -> tuple[set[int], set[int]]:
        """Nodes evicting ``v`` makes backward recompute, and unrecomputable ones to save."""
        todo, redo, keep = [v], set(), set()
        while todo:
            u = todo.pop()
            if u in redo or u in recomputed or (u in saved and u != v):
                continue
            if not p[u].can_recompute:
                keep.add(u)
                continue
            redo.add(u)
            todo.extend(p[u].inputs)
        return redo, keep

    def ratio(v: int) -> float:
        redo, keep = closure(v)
        freed = p[v].bytes - sum(p[k].bytes for k in keep)
        return freed / (1.0 + sum(costs[u] for u in redo))

    order = sorted((v for v in saved if p[v].bytes > 0 and p[v].can_recompute), key=ratio)
    while used > max_bytes and order:
        v = order.pop()
        redo, keep = closure(v)
        saved.discard(v)
        saved |= keep
        recomputed |= redo
        used = sum(p[i].bytes for i in saved)
    if used > max_bytes:  # what is left cannot be evicted: fall back to full rematerialization
        return full_remat(joint)
    return [p[i].node for i in sorted(saved)]


def memory_budget(joint: JointGraph, **options: object) -> list[fx.Node] | Cut:
    """The ``"memory_budget"`` strategy: ``partition(jg, "memory_budget", budget=0.3)``."""
    return _memory_budget_options(options)(joint)


def _memory_budget_options(options: Mapping[str, object]) -> MemoryBudget:
    """``memory_budget``'s options from ``partition``'s keywords (its declared option check:
    an unknown name, a bad value or a missing limit raises ``InvalidArgumentError`` when
    ``jit`` is made).

    >>> _memory_budget_options({"budget": 0.5}).budget
    0.5
    """
    return parse_options(MemoryBudget, "memory_budget", options)


_OPTIMAL_HINTS = {
    "solver": "optimal always solves the ILP; use 'memory_budget' for solver=",
    "max_bytes": "optimal takes a budget fraction; use 'memory_budget' for max_bytes=",
}


def optimal(joint: JointGraph, **options: object) -> list[fx.Node] | Cut:
    """The ``"optimal"`` strategy: the exact ILP at a required ``budget`` (options ``budget``,
    ``cost``, ``time_limit``)."""
    return _optimal_options(options)(joint)


def _optimal_options(options: Mapping[str, object]) -> MemoryBudget:
    """``optimal``'s options from ``partition``'s keywords (its declared option check): those
    of ``memory_budget`` but ``solver`` and ``max_bytes``, and ``budget`` is required.

    >>> _optimal_options({"budget": 0.3}).solver
    'ilp'
    """
    accepted = ("budget", "cost", "time_limit", "at", "offload")
    check_names("optimal", options, accepted, hints=_OPTIMAL_HINTS)
    if "budget" not in options:
        raise InvalidArgumentError(
            f"optimal needs budget= ({_BUDGET}); got options: {', '.join(options) or 'none'}"
        )
    _check_values("optimal", options)
    return parse_options(MemoryBudget, "optimal", {**options, "solver": "ilp"})


#: options that change nothing of a peak budget but the unrolled step's ILP
_TUNING = frozenset({"peak_bytes", "solver", "cost", "time_limit"})


def _peak_goal(options: Mapping[str, Any]) -> PeakGoal | None:
    """A ``peak_bytes`` limit is a goal for the whole step (with ``budget``, ``max_bytes``,
    ``offload`` or ``at`` too, the unrolled step's ILP plans it: they bound saved bytes).

    >>> _peak_goal({"peak_bytes": 1024}), _peak_goal({"budget": 0.5})
    (PeakGoal(limit=1024), None)
    """
    peak = options.get("peak_bytes")
    if peak is None or not set(options) <= _TUNING or options.get("cost", "flops") != "flops":
        return None
    return PeakGoal(limit=int(peak))


register(
    "memory_budget",
    memory_budget,
    examples=(
        {"budget": 0.0},
        {"budget": 0.5},
        {"budget": 1.0},
        {"budget": 0.4, "solver": "greedy"},
        {"budget": 0.0, "offload": Offload(bandwidth=math.inf)},
        {"budget": 0.5, "offload": Offload(bandwidth=1e9, host_bytes=4096, compute_rate=1e9)},
    ),
    check_options=_memory_budget_options,
    peak_goal=lambda options: _peak_goal(options),
)
register("optimal", optimal, examples=({"budget": 0.3},), check_options=_optimal_options)
