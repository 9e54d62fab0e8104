"""``"memory_budget"`` and ``"optimal"``: the least recompute that fits an activation budget.

``budget`` is a fraction on torch's scale: 1.0 is ``min_cut``'s activation bytes, 0.0 is
``full_remat``'s, linear in between (above 1.0 the solver may save more than ``min_cut`` to
recompute less). ``max_bytes`` gives the budget in bytes instead. ``solver="ilp"`` solves the
exact 0/1 program with HiGHS; ``"greedy"`` evicts saved values from ``min_cut``'s set by bytes
freed per unit of recompute cost (fast on huge graphs, no optimality guarantee). ``cost`` is
``"flops"`` or a callable ``node -> cost`` (e.g. a measured runtime model).

``"optimal"`` is ``memory_budget`` with the ILP and a required ``budget``: the name to use when
you want the exact answer and want to say so.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx

from functrans.extend import InvalidPartitionError, JointGraph, activation_bytes, split

from . import register
from ._ilp import solve_ilp
from ._remat_problem import RematProblem, build_problem
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
    (0, ('mm', 'tanh'))
    """

    budget: float | None = None
    max_bytes: int | None = None
    solver: str = "ilp"
    cost: str | Callable[[fx.Node], float] = "flops"
    time_limit: float = 20.0

    def __post_init__(self) -> None:
        if (self.budget is None) == (self.max_bytes is None):
            raise ValueError(
                "memory_budget needs exactly one of budget= (a fraction) or max_bytes="
            )
        if self.budget is not None and self.budget < 0:
            raise ValueError(f"budget must be >= 0, got {self.budget}")
        if self.solver not in ("ilp", "greedy"):
            raise ValueError(f"solver must be 'ilp' or 'greedy', got {self.solver!r}")
        if self.cost != "flops" and not callable(self.cost):
            raise ValueError(f"cost must be 'flops' or a callable node -> cost, got {self.cost!r}")

    @property
    def __name__(self) -> str:  # shown as the partition's strategy name
        return "memory_budget"

    def limit(self, joint: JointGraph) -> tuple[int, int]:
        """(budget in bytes, smallest achievable activation bytes)."""
        low = _activation(joint, full_remat(joint))
        if self.max_bytes is not None:
            return self.max_bytes, low
        high = _activation(joint, min_cut(joint))
        assert self.budget is not None
        return int(low + self.budget * (high - low)), low

    def __call__(self, joint: JointGraph) -> list[fx.Node]:
        max_bytes, low = self.limit(joint)
        if max_bytes < low:
            raise InvalidPartitionError(
                f"memory_budget: {max_bytes} activation bytes is below the smallest achievable "
                f"{low} bytes (random-op outputs and MUST_SAVE values must be saved)"
            )
        problem = build_problem(joint, None if self.cost == "flops" else self.cost)  # type: ignore[arg-type]
        if self.solver == "greedy":
            return greedy(joint, problem, max_bytes)
        result = solve_ilp(problem, max_bytes, self.time_limit)
        if result is None:  # a feasible set exists (>= low), so the time limit struck first
            warnings.warn(
                f"memory_budget: the ILP found no saved set within its time limit "
                f"({self.time_limit:g} s); falling back to full rematerialization",
                stacklevel=3,
            )
            return full_remat(joint)
        return [problem.nodes[i] for i in result.saved]


def _activation(joint: JointGraph, saved: list[fx.Node]) -> int:
    return sum(activation_bytes(n) for n in split(joint, saved).saved)


def greedy(joint: JointGraph, p: RematProblem, max_bytes: int) -> list[fx.Node]:
    """Start from ``min_cut``'s saved set; evict the values that free the most bytes per unit
    of recompute cost until the rest fits ``max_bytes``."""
    index = {n: i for i, n in enumerate(p.nodes)}
    saved = {index[n] for n in split(joint, min_cut(joint)).saved}
    used = sum(p.bytes[i] for i in saved)
    recomputed: set[int] = set()

    def closure(v: int) -> tuple[set[int], set[int]]:
        """Nodes evicting ``v`` makes backward recompute, and unrecomputable ones to save."""
        todo, redo, keep = [v], set(), set()
        while todo:
            u = todo.pop()
            if u in redo or u in recomputed or (u in saved and u != v):
                continue
            if not p.can_recompute[u]:
                keep.add(u)
                continue
            redo.add(u)
            todo.extend(p.inputs[u])
        return redo, keep

    def ratio(v: int) -> float:
        redo, keep = closure(v)
        freed = p.bytes[v] - sum(p.bytes[k] for k in keep)
        return freed / (1.0 + sum(p.cost[u] for u in redo))

    order = sorted((v for v in saved if p.bytes[v] > 0 and p.can_recompute[v]), key=ratio)
    while used > max_bytes and order:
        v = order.pop()
        redo, keep = closure(v)
        saved.discard(v)
        saved |= keep
        recomputed |= redo
        used = sum(p.bytes[i] for i in saved)
    if used > max_bytes:  # what is left cannot be evicted: fall back to full rematerialization
        return full_remat(joint)
    return [p.nodes[i] for i in sorted(saved)]


def memory_budget(joint: JointGraph, **options: object) -> list[fx.Node]:
    """The ``"memory_budget"`` strategy: ``partition(jg, "memory_budget", budget=0.3)``."""
    return MemoryBudget(**options)(joint)  # type: ignore[arg-type]


def optimal(joint: JointGraph, *, budget: float, **options: object) -> list[fx.Node]:
    """The ``"optimal"`` strategy: the exact ILP at a required ``budget``."""
    return MemoryBudget(budget=budget, solver="ilp", **options)(joint)  # type: ignore[arg-type]


register(
    "memory_budget",
    memory_budget,
    examples=(
        {"budget": 0.0},
        {"budget": 0.5},
        {"budget": 1.0},
        {"budget": 0.4, "solver": "greedy"},
    ),
)
register("optimal", optimal, examples=({"budget": 0.3},))
