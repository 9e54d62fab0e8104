"""Exact 0/1 program for "least recompute cost within an activation-byte budget" (HiGHS).

Variables per forward node ``v``: ``s_v`` (saved) and ``r_v`` (computed in backward).
Constraints: every value backward reads is saved or recomputed (``s_d + r_d >= 1``); a
recomputed node's inputs are available (``s_u + r_u >= r_v``); saved bytes fit the budget.
Objective: recompute cost; then, at that optimal cost, fewest saved bytes (a second solve). The
lexicographic order makes the Pareto front monotone: a smaller budget never saves more.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from ._remat_problem import RematProblem

__all__ = ["IlpResult", "solve_ilp"]


@dataclass(frozen=True)
class IlpResult:
    saved: list[int]  # node indices
    cost: float
    optimal: bool  # False when the time limit stopped HiGHS with a feasible point


def _constraints(p: RematProblem) -> tuple[coo_matrix, np.ndarray]:
    """Rows ``A x >= lb`` over ``x = [s_0..s_n-1, r_0..r_n-1]``."""
    n = len(p.nodes)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lb: list[float] = []
    for d in p.drains:
        rows += [len(lb), len(lb)]
        cols += [d, n + d]
        vals += [1.0, 1.0]
        lb.append(1.0)
    for v, ins in enumerate(p.inputs):
        for u in ins:
            rows += [len(lb)] * 3
            cols += [u, n + u, n + v]
            vals += [1.0, 1.0, -1.0]
            lb.append(0.0)
    return coo_matrix((vals, (rows, cols)), shape=(len(lb), 2 * n)), np.array(lb)


def _solve(c: np.ndarray, cons: list[LinearConstraint], ub: np.ndarray, limit: float) -> object:
    return milp(
        c=c,
        integrality=np.ones_like(c),
        bounds=Bounds(np.zeros_like(ub), ub),
        constraints=cons,
        options={"time_limit": limit, "disp": False},
    )


def solve_ilp(p: RematProblem, max_bytes: float, time_limit: float) -> IlpResult | None:
    """Optimal saved set within ``max_bytes``, or None if no saved set fits."""
    n = len(p.nodes)
    a, lb = _constraints(p)
    size = np.array(p.bytes, dtype=float)
    cost = np.array(p.cost, dtype=float)
    budget = LinearConstraint(np.concatenate([size, np.zeros(n)])[None, :], -np.inf, max_bytes)
    cons = [LinearConstraint(a.tocsr(), lb, np.inf), budget]
    ub = np.concatenate([np.array(p.can_save, float), np.array(p.can_recompute, float)])
    first = _solve(np.concatenate([np.zeros(n), cost]), cons, ub, time_limit)
    if first.x is None:  # type: ignore[attr-defined]
        return None
    optimal = first.status == 0  # type: ignore[attr-defined]
    best = float(first.fun)  # type: ignore[attr-defined]
    x = first.x  # type: ignore[attr-defined]
    # second solve: the fewest bytes at that cost (tolerance for HiGHS' float arithmetic)
    at_cost = LinearConstraint(
        np.concatenate([np.zeros(n), cost])[None, :], -np.inf, best + 1e-6 * max(1.0, best)
    )
    second = _solve(np.concatenate([size, np.zeros(n)]), [*cons, at_cost], ub, time_limit)
    if second.x is not None:  # type: ignore[attr-defined]
        x = second.x  # type: ignore[attr-defined]
        optimal = optimal and second.status == 0  # type: ignore[attr-defined]
    if not optimal:
        warnings.warn(
            f"memory_budget: the ILP hit its time limit ({time_limit:g} s); using the best "
            "feasible saved set found, which may not be optimal",
            stacklevel=4,
        )
    saved = [i for i in range(n) if x[i] > 0.5]
    return IlpResult(saved, float(cost @ np.round(x[n:])), optimal)
