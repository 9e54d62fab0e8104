"""Exact 0/1 program for "least recompute cost within an activation-byte budget" (HiGHS).

Variables per forward node ``v``: ``s_v`` (saved) and ``r_v`` (computed in backward).
Constraints: every value backward reads is saved or recomputed (``s_d + r_d >= 1``); a
recomputed node's inputs are available (``s_u + r_u >= r_v``); saved bytes fit the budget.
Objective: recompute cost; then, at that optimal cost, fewest saved bytes (a second solve). The
lexicographic order makes the Pareto front monotone: a smaller budget never saves more.

With offload (:class:`OffloadTerms`) a third variable ``o_v`` (kept in host memory) counts as
available like ``s_v`` but its bytes go to the host limit, not the device budget. Copy time is
priced by two continuous variables, the bytes whose copy the forward (out) and the backward
(back) compute cannot hide: ``e_f >= sum(b_v o_v) - hidden_forward`` and likewise ``e_b``, at
``price`` cost units per exposed byte. Objective: recompute cost plus exposed copies; then the
fewest offloaded bytes; then the fewest saved bytes (three solves).

HiGHS runs with its log off and with the process's stdout pointed at ``os.devnull``
(:func:`quiet_stdout`), so solving prints nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from scipy.sparse import coo_matrix, hstack

from functrans.extend import CutProblem

from ._peak import SCALE, PeakModel, optimize

if TYPE_CHECKING:
    from scipy.optimize import LinearConstraint

__all__ = ["IlpResult", "OffloadTerms", "PeakTerms", "quiet_stdout", "solve_ilp"]


_PEAK_GAP = 1e-3
_TIE = 1e-6


@dataclass(frozen=True)
class IlpResult:
    saved: list[int]  # node indices (on the device)
    cost: float
    optimal: bool  # False when the time limit stopped HiGHS with a feasible point
    offloaded: list[int] = field(default_factory=list)  # node indices kept in host memory
    #: the modelled peak of the step (:class:`PeakTerms`), None without peak terms
    peak: float | None = None


@dataclass(frozen=True)
class PeakTerms:
    """The step's modelled peak (:class:`~functrans.partitioners._peak.PeakModel`) within
    ``limit`` bytes; ``first`` minimises the peak before the recompute cost (the lowest peak
    the model reaches) instead of after it."""

    model: PeakModel
    limit: float
    first: bool = False


@dataclass(frozen=True)
class OffloadTerms:
    """The offload part of the program (see the module docstring): which values may go to
    host memory, the host limit, the copy bytes compute hides, and the price of the rest."""

    allowed: Sequence[bool]
    host_bytes: float  # inf: no limit
    hidden_forward: float  # bytes copied out that forward compute hides (inf: all)
    hidden_backward: float
    price: float  # cost units per exposed byte


def _constraints(p: CutProblem, kinds: int) -> tuple[coo_matrix, np.ndarray]:
    """Rows ``A x >= lb`` over ``x = [s_0..s_n-1, r_0..r_n-1]`` (and ``o_0..o_n-1`` when
    ``kinds`` is 3: an offloaded value is available like a saved one)."""
    n = len(p)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lb: list[float] = []
    for d in p.drains():
        rows += [len(lb)] * kinds
        cols += [k * n + d for k in range(kinds)]
        vals += [1.0] * kinds
        lb.append(1.0)
    for value in p:
        v = value.index
        for u in value.inputs:
            rows += [len(lb)] * (kinds + 1)
            cols += [*(k * n + u for k in range(kinds)), n + v]
            vals += [*([1.0] * kinds), -1.0]
            lb.append(0.0)
    if kinds == 3:  # a value is saved on the device or offloaded, not both
        for value in p:
            rows += [len(lb)] * 2
            cols += [value.index, 2 * n + value.index]
            vals += [-1.0, -1.0]
            lb.append(-1.0)
        # a saved view keeps its base on the device: never with the base offloaded
        for value in p:
            root = value.storage[0]
            if root is not value.node and root in p.index:
                rows += [len(lb)] * 2
                cols += [2 * n + p.index[root], value.index]
                vals += [-1.0, -1.0]
                lb.append(-1.0)
    width = kinds * n + (2 if kinds == 3 else 0)
    return coo_matrix((vals, (rows, cols)), shape=(len(lb), width)), np.array(lb)


class _MilpResult(Protocol):
    """What we read of scipy's ``OptimizeResult``."""

    x: np.ndarray | None
    status: int
    fun: float


def _solve(
    c: np.ndarray,
    cons: list[LinearConstraint],
    ub: np.ndarray,
    limit: float,
    integrality: np.ndarray | None = None,
    gap: float | None = None,
) -> _MilpResult:
    options: dict[str, float | bool] = {"time_limit": limit, "disp": False}
    if gap is not None:
        options["mip_rel_gap"] = gap
    with quiet_stdout():
        result: _MilpResult = optimize().milp(
            c=c,
            integrality=np.ones_like(c) if integrality is None else integrality,
            bounds=optimize().Bounds(np.zeros_like(ub), ub),
            constraints=cons,
            options=options,
        )
    return result


@functools.cache
def _c_fflush() -> Callable[[ctypes.c_void_p | None], int] | None:
    """libc's ``fflush``, where ctypes finds it (not on Windows)."""
    try:
        return ctypes.CDLL(None).fflush
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
    p: CutProblem,
    costs: Sequence[float],
    max_bytes: float,
    time_limit: float,
    offload: OffloadTerms | None = None,
    peak: PeakTerms | None = None,
) -> IlpResult | None:
    """Optimal saved (and, with ``offload``, offloaded) set within ``max_bytes`` activation
    bytes (``math.inf``: no such limit) and, with ``peak``, a modelled step peak within its
    limit (``costs``: each value's recompute cost), or None if no saved set fits."""
    n = len(p)
    kinds = 2 if offload is None else 3
    a, lb = _constraints(p, kinds)
    size = np.array([v.bytes for v in p], dtype=float)
    zeros = np.zeros(n)
    cost = np.array(costs, dtype=float)
    cons = [optimize().LinearConstraint(a.tocsr(), lb, np.inf)]
    ub = [np.array([v.can_save for v in p], float), np.array([v.can_recompute for v in p], float)]
    objectives = [np.concatenate([zeros, cost]), np.concatenate([size, zeros])]
    integrality = np.ones(2 * n)
    if offload is not None:
        cons += _offload_rows(offload, size)
        ub += [np.array(offload.allowed, float), np.full(2, np.inf)]
        price = np.full(2, offload.price)
        objectives = [
            np.concatenate([zeros, cost, zeros, price]),
            np.concatenate([zeros, zeros, size, np.zeros(2)]),
            np.concatenate([size, zeros, zeros, np.zeros(2)]),
        ]
        integrality = np.concatenate([np.ones(3 * n), np.zeros(2)])
    width = a.shape[1]
    unscaled = objectives[0]  # the recompute cost (with offload: plus exposed copies)
    device = np.zeros(width)
    device[:n] = size
    if math.isfinite(max_bytes):
        cons.append(optimize().LinearConstraint(device[None, :], -np.inf, max_bytes))
    upper = np.concatenate(ub)
    if peak is None and offload is None:
        cons, objectives, upper, integrality = _storage_tie_break(
            p, size, cons, objectives, upper, integrality
        )
    peak_col = None
    if peak is not None:
        rows, total, peak_col = peak.model.constraints(width, n, kinds, peak.limit)
        cons = [_widen(c, total) for c in cons] + rows
        # recompute cost and the modelled peak (in the order asked); the saved-bytes and
        # offloaded-bytes tie-breaks are dropped: the peak already orders what they would, and
        # each solve of a peak model costs seconds on a transformer stack
        at_peak = np.zeros(total)
        at_peak[peak_col] = 1.0
        recompute = np.concatenate([objectives[0], np.zeros(total - width)])
        recompute /= max(1.0, float(np.abs(recompute).max()))  # near 1, as the peak in MiB
        # ...and among equal costs, the fewest saved bytes (a weight no cost difference feels)
        recompute[:n] += _TIE * size / max(1.0, float(size.sum()))
        objectives = [at_peak, recompute] if peak.first else [recompute, at_peak]
        for i in peak.model.boundaries:  # recomputing a boundary reaches into earlier segments
            if p[i].can_save:
                upper[n + i] = 0.0
        for i in peak.model.views:  # save the base instead: a view keeps it alive anyway
            upper[i] = 0.0
        upper = np.concatenate([upper, np.full(total - width, np.inf)])
        integrality = np.concatenate([integrality, np.zeros(total - width)])
    # a peak model is solved to a 0.1% gap: exact solves of a transformer stack take seconds
    gap = _PEAK_GAP if peak is not None else None
    x, optimal = _lexicographic(objectives, cons, upper, time_limit, integrality, gap)
    if x is None:
        return None
    if not optimal:
        warnings.warn(
            f"memory_budget: the ILP hit its time limit ({time_limit:g} s); using the best "
            "feasible saved set found, which may not be optimal",
            stacklevel=4,
        )
    chosen = np.where(integrality == 0, x, np.round(x))
    return IlpResult(
        saved=[i for i in range(n) if chosen[i] > 0.5],
        cost=float(unscaled @ chosen[: len(unscaled)]),
        optimal=optimal,
        offloaded=[i for i in range(n) if kinds == 3 and chosen[2 * n + i] > 0.5],
        peak=None if peak_col is None else float(x[peak_col]) * SCALE,
    )


def _storage_tie_break(
    p: CutProblem,
    size: np.ndarray,
    cons: list[LinearConstraint],
    objectives: list[np.ndarray],
    upper: np.ndarray,
    integrality: np.ndarray,
) -> tuple[list[LinearConstraint], list[np.ndarray], np.ndarray, np.ndarray]:
    """The saved-bytes tie-break counted by storage: values that share one (a value and its
    views) cost their storage once, through one more variable per shared storage, at least
    each member's saved variable. Counted per value, saving ``tanh`` and its ``unsqueeze``
    (8 bytes) tied with saving the ``unsqueeze`` and tanh's derivative (16)."""
    n = len(p)
    groups: dict[Any, list[int]] = {}
    for i, v in enumerate(p):
        groups.setdefault(v.storage[0], []).append(i)
    shared = [g for g in groups.values() if len(g) > 1]
    if not shared:
        return cons, objectives, upper, integrality
    width = len(upper)
    k = len(shared)
    members = [(r, i) for r, g in enumerate(shared) for i in g]
    m = len(members)
    rows = coo_matrix(  # one row per member i of shared storage r: its variable - x_i >= 0
        (
            [1.0] * m + [-1.0] * m,
            ([*range(m), *range(m)], [*(width + r for r, _ in members), *(i for _, i in members)]),
        ),
        shape=(m, width + k),
    )
    by_storage = size.copy()
    for g in shared:
        by_storage[g] = 0.0
    tie = np.concatenate([by_storage, np.zeros(width - n), [size[g].max() for g in shared]])
    widened = [_widen(c, width + k) for c in cons]
    widened.append(optimize().LinearConstraint(rows.tocsr(), 0.0, np.inf))
    first = np.concatenate([objectives[0], np.zeros(width + k - len(objectives[0]))])
    return (
        widened,
        [first, tie],
        np.concatenate([upper, np.ones(k)]),
        np.concatenate([integrality, np.zeros(k)]),
    )


def _widen(c: LinearConstraint, width: int) -> LinearConstraint:
    """``c`` over more variables (zero coefficients for the new ones)."""
    a = c.A
    extra = width - a.shape[1]
    wide = hstack([coo_matrix(a), coo_matrix((a.shape[0], extra))]).tocsr()
    return optimize().LinearConstraint(wide, c.lb, c.ub)


def _offload_rows(t: OffloadTerms, size: np.ndarray) -> list[LinearConstraint]:
    """Host bytes within the limit; exposed copy bytes ``e >= offloaded bytes - hidden``."""
    n = len(size)
    rows = []
    host = np.concatenate([np.zeros(2 * n), size, np.zeros(2)])
    if math.isfinite(t.host_bytes):
        rows.append(optimize().LinearConstraint(host[None, :], -np.inf, t.host_bytes))
    for k, hidden in enumerate((t.hidden_forward, t.hidden_backward)):
        if math.isfinite(hidden):
            row = host.copy()
            row[3 * n + k] = -1.0
            rows.append(optimize().LinearConstraint(row[None, :], -np.inf, hidden))
    return rows


def _lexicographic(
    objectives: list[np.ndarray],
    cons: list[LinearConstraint],
    ub: np.ndarray,
    limit: float,
    integrality: np.ndarray | None,
    gap: float | None = None,
) -> tuple[np.ndarray | None, bool]:
    """Minimise each objective in turn, keeping the earlier ones at their optimum (with a
    tolerance for HiGHS' float arithmetic, and ``gap``, the relative MIP gap it may stop at);
    returns the point and whether every solve was optimal."""
    x: np.ndarray | None = None
    optimal = True
    slack = max(1e-6, gap or 0.0)
    for c in objectives:
        result = _solve(c, cons, ub, limit, integrality, gap)
        if result.x is None:
            return x, optimal and x is not None
        x, best = result.x, float(result.fun)
        optimal = optimal and result.status == 0
        cons = [
            *cons,
            optimize().LinearConstraint(c[None, :], -np.inf, best + slack * max(1.0, abs(best))),
        ]
    return x, optimal
