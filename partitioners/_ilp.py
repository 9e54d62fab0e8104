"""Exact 0/1 program for "least recompute cost within an activation-byte budget" (HiGHS).

Variables per forward node ``v``: ``s_v`` (saved) and ``r_v`` (computed in backward).
Constraints: every value backward reads is saved or recomputed (``s_d + r_d >= 1``); a
recomputed node's inputs are available (``s_u + r_u >= r_v``); saved bytes fit the budget.
Objective: recompute cost; then, at that optimal cost, fewest saved bytes (a second solve). The
lexicographic order makes the Pareto front monotone: a smaller budget never saves more.

HiGHS runs with its log off and with the process's stdout pointed at ``os.devnull``
(:func:`quiet_stdout`), so solving prints nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from functrans.extend import CutProblem

__all__ = ["IlpResult", "quiet_stdout", "solve_ilp"]


@dataclass(frozen=True)
class IlpResult:
    saved: list[int]  # node indices
    cost: float
    optimal: bool  # False when the time limit stopped HiGHS with a feasible point


def _constraints(p: CutProblem) -> tuple[coo_matrix, np.ndarray]:
    """Rows ``A x >= lb`` over ``x = [s_0..s_n-1, r_0..r_n-1]``."""
    n = len(p)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lb: list[float] = []
    for d in p.drains():
        rows += [len(lb), len(lb)]
        cols += [d, n + d]
        vals += [1.0, 1.0]
        lb.append(1.0)
    for value in p:
        v = value.index
        for u in value.inputs:
            rows += [len(lb)] * 3
            cols += [u, n + u, n + v]
            vals += [1.0, 1.0, -1.0]
            lb.append(0.0)
    return coo_matrix((vals, (rows, cols)), shape=(len(lb), 2 * n)), np.array(lb)


class _MilpResult(Protocol):
    """What we read of scipy's ``OptimizeResult``."""

    x: np.ndarray | None
    status: int
    fun: float


def _solve(
    c: np.ndarray, cons: list[LinearConstraint], ub: np.ndarray, limit: float
) -> _MilpResult:
    with quiet_stdout():
        result: _MilpResult = milp(
            c=c,
            integrality=np.ones_like(c),
            bounds=Bounds(np.zeros_like(ub), ub),
            constraints=cons,
            options={"time_limit": limit, "disp": False},
        )
    return result


@functools.cache
def _c_fflush() -> Callable[[ctypes.c_void_p | None], int] | None:
    """libc's ``fflush``, where ctypes finds it (not on Windows)."""
    try:
        return ctypes.CDLL(None).fflush  # type: ignore[no-any-return]
    except (OSError, AttributeError, TypeError):
        return None


class _QuietStdout:
    """Reference-counted redirection of file descriptor 1, safe when threads overlap: the first
    caller in points it at ``os.devnull``, the last one out restores it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: int | None = None

    def enter(self) -> None:
        with self._lock:
            self._depth += 1
            if self._depth > 1:
                return
            for stream in (sys.stdout, sys.__stdout__):
                with contextlib.suppress(Exception):
                    stream.flush()  # type: ignore[union-attr]  # Python's buffer goes out first
            try:  # best effort: without a stdout or a devnull there is nothing to silence
                saved = os.dup(1)
            except OSError:
                return
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                try:
                    os.dup2(devnull, 1)
                finally:
                    os.close(devnull)
            except OSError:
                os.close(saved)
                return
            self._saved = saved

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth > 0 or self._saved is None:
                return
            fflush = _c_fflush()
            if fflush is not None:
                fflush(None)  # C stdio's buffer: flushed while it still goes to devnull
            os.dup2(self._saved, 1)
            os.close(self._saved)
            self._saved = None


_QUIET = _QuietStdout()


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Send what native code writes to the process's stdout to ``os.devnull`` meanwhile.

    scipy runs HiGHS with its log off (``disp=False``), yet HiGHS builds have printed stray
    lines from C++ straight to file descriptor 1 (a banner, presolve notes), where
    ``contextlib.redirect_stdout`` cannot reach them. Output from other threads to stdout
    during a solve (a fraction of a second on most graphs) is dropped too; stderr is untouched.

    >>> import os
    >>> with quiet_stdout():
    ...     _ = os.write(1, b"not shown")
    """
    _QUIET.enter()
    try:
        yield
    finally:
        _QUIET.exit()


def solve_ilp(
    p: CutProblem, costs: Sequence[float], max_bytes: float, time_limit: float
) -> IlpResult | None:
    """Optimal saved set within ``max_bytes`` (``costs``: each value's recompute cost), or None
    if no saved set fits."""
    n = len(p)
    a, lb = _constraints(p)
    size = np.array([v.bytes for v in p], dtype=float)
    cost = np.array(costs, dtype=float)
    budget = LinearConstraint(np.concatenate([size, np.zeros(n)])[None, :], -np.inf, max_bytes)
    cons = [LinearConstraint(a.tocsr(), lb, np.inf), budget]
    can_save = [v.can_save for v in p]
    ub = np.concatenate([np.array(can_save, float), np.array([v.can_recompute for v in p], float)])
    first = _solve(np.concatenate([np.zeros(n), cost]), cons, ub, time_limit)
    if first.x is None:
        return None
    optimal = first.status == 0
    best = float(first.fun)
    x = first.x
    # second solve: the fewest bytes at that cost (tolerance for HiGHS' float arithmetic)
    at_cost = LinearConstraint(
        np.concatenate([np.zeros(n), cost])[None, :], -np.inf, best + 1e-6 * max(1.0, best)
    )
    second = _solve(np.concatenate([size, np.zeros(n)]), [*cons, at_cost], ub, time_limit)
    if second.x is not None:
        x = second.x
        optimal = optimal and second.status == 0
    if not optimal:
        warnings.warn(
            f"memory_budget: the ILP hit its time limit ({time_limit:g} s); using the best "
            "feasible saved set found, which may not be optimal",
            stacklevel=4,
        )
    saved = [i for i in range(n) if x[i] > 0.5]
    return IlpResult(saved, float(cost @ np.round(x[n:])), optimal)
