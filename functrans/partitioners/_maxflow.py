"""Minimum s-t cut with scipy's compiled max-flow (Dinic), on exact integer capacities.

Why this solver: ``scipy.sparse.csgraph.maximum_flow`` runs Dinic's algorithm in compiled code
on a CSR graph, which handles 100k-edge networks in milliseconds, where a pure-Python max-flow
(networkx, what torch's partitioner uses) spends most of a partition's time. Its catch: it
computes in int32 and silently returns garbage on larger int64 capacities. So capacities are
scaled here, never by the caller: divided by their gcd (tensor sizes share large power-of-two
factors), and, only if their sum still does not fit, rounded up to a coarser unit (the cut is
then optimal up to that rounding, and ``exact`` says so).

Ties are broken by a second capacity per edge (``tiebreak``), lexicographically: a second
max-flow runs on the first one's residual graph, where an edge the first flow left unsaturated
(or a reverse residual edge) may not be cut and a saturated one costs its second capacity. Its
minimum cuts are exactly the first problem's minimum cuts, and the one found has the least
second capacity. Two small solves instead of one with mixed scales, which int32 cannot hold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

__all__ = ["INF", "Cut", "min_cut"]

INF = -1  # marks an uncuttable edge in the caller's capacity list
_LIMIT = (1 << 31) - 1  # scipy's int32 ceiling for capacities and flows


@dataclass(frozen=True)
class Cut:
    """The source side of a minimum cut, the one closest to the source (the smallest one)."""

    source_side: np.ndarray  # bool per network node
    value: int  # capacity of the reported cut, in the caller's units
    exact: bool  # False if capacities had to be rounded to fit int32 (the cut may then be
    # slightly above the minimum)
    finite: bool  # False if every cut crosses an INF edge


def _feasible_bound(
    n: int, src: np.ndarray, dst: np.ndarray, caps: np.ndarray, s: int, t: int
) -> int | None:
    """Value of one finite s-t cut (an upper bound on the minimum), or None if none exists.

    The nodes the source reaches through uncuttable edges are on the source side of every
    finite cut, and so may be every node that cannot reach the sink at all; cutting every edge
    from those into the rest is a valid cut, and often a tight one.
    """
    inf = caps == INF
    sub = csr_matrix((np.ones(int(inf.sum())), (src[inf], dst[inf])), shape=(n, n))
    closure = np.zeros(n, dtype=bool)
    closure[breadth_first_order(sub, s, directed=True, return_predecessors=False)] = True
    if closure[t]:  # the sink hangs on the source by uncuttable edges
        return None
    back = csr_matrix((np.ones(len(src)), (dst, src)), shape=(n, n))
    reaches_t = np.zeros(n, dtype=bool)
    reaches_t[breadth_first_order(back, t, directed=True, return_predecessors=False)] = True
    closure |= ~reaches_t
    leaving = closure[src] & ~closure[dst]
    return int(sum(int(c) for c in caps[leaving]))


def _scale(caps: Sequence[int], bound: int) -> tuple[np.ndarray, int, int, bool]:
    """Map capacities to int32: returns (scaled caps, inf value, unit, exact).

    ``bound`` is the value of some finite cut. A capacity above it can never be in a minimum
    cut, so it is clamped to the uncuttable value, which is chosen to exceed any cut of
    capacities at most ``bound`` even after rounding; then only the minimum cut's own scale has
    to fit in int32, not the sum of all capacities.
    """
    small = [c for c in caps if c != INF and c <= bound]
    positive = [c for c in small if c > 0]
    unit = math.gcd(*positive) if positive else 1
    edges = len(small)
    exact = True  # the gcd divides every capacity that matters
    if -(-bound // unit) + edges + 1 > _LIMIT // 2:  # coarser unit, rounding capacities up
        unit = -(-bound // (_LIMIT // 4 - edges - 1))
        exact = False
    inf = -(-bound // unit) + edges + 1
    out = [inf if c == INF or c > bound else -(-c // unit) for c in caps]
    return np.array(out, dtype=np.int32), inf, unit, exact


def min_cut(
    num_nodes: int,
    src: Sequence[int],
    dst: Sequence[int],
    caps: Sequence[int],
    s: int,
    t: int,
    tiebreak: Sequence[int] | None = None,
) -> Cut:
    """Minimum ``s``-``t`` cut of the network with edges ``src[i] -> dst[i]`` of ``caps[i]``
    (``INF`` for uncuttable). Parallel edges must already be merged by the caller. Among
    minimum cuts, the one of least ``tiebreak`` capacity (one small int per edge; zero-capacity
    edges may carry one), then the one closest to the source.

    >>> cut = min_cut(4, [0, 1, 2, 0], [1, 2, 3, 2], [INF, 5, INF, 3], 0, 3)
    >>> cut.value, cut.source_side.tolist()
    (8, [True, True, False, False])
    >>> min_cut(3, [0, 1], [1, 2], [4, 4], 0, 2).source_side.tolist()  # a tie: nearest the source
    [True, False, False]
    >>> min_cut(3, [0, 1], [1, 2], [4, 4], 0, 2, tiebreak=[1, 0]).source_side.tolist()
    [True, True, False]
    """
    src_a, dst_a = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    real = np.asarray(caps, dtype=object)
    bound = _feasible_bound(num_nodes, src_a, dst_a, real, s, t)
    if bound is None:  # every cut crosses an uncuttable edge
        return Cut(np.zeros(num_nodes, dtype=bool), 0, True, False)
    for _ in range(3):  # a rounded solve still finds a cut, whose value is a tighter bound
        side, exact, residual = _solve(num_nodes, src_a, dst_a, caps, s, t, bound)
        value = int(sum(int(c) for c in real[side[src_a] & ~side[dst_a]]))
        if exact or value >= bound:
            break
        bound = value
    if tiebreak is not None and exact:  # rounded capacities have no exact ties to break
        side = _break_ties(residual, src_a, dst_a, np.asarray(tiebreak, dtype=np.int64), s, t)
    return Cut(side, value, exact, True)


def _solve(
    n: int, src: np.ndarray, dst: np.ndarray, caps: Sequence[int], s: int, t: int, bound: int
) -> tuple[np.ndarray, bool, csr_matrix]:
    """One max-flow at the scale ``bound`` allows: the smallest source side of a min cut,
    whether it is exact, and the residual graph."""
    cap, _inf, _unit, exact = _scale(caps, bound)
    graph = csr_matrix((cap, (src, dst)), shape=(n, n))
    graph.sum_duplicates()
    result = maximum_flow(graph, s, t, method="dinic")
    residual = (graph - result.flow).tocsr()
    residual.data[residual.data < 0] = 0
    residual.eliminate_zeros()
    # nodes the source still reaches through residual capacity form the smallest source side
    reach = breadth_first_order(residual, s, directed=True, return_predecessors=False)
    side = np.zeros(n, dtype=bool)
    side[reach] = True
    return side, exact, residual


def _break_ties(
    residual: csr_matrix, src: np.ndarray, dst: np.ndarray, tiebreak: np.ndarray, s: int, t: int
) -> np.ndarray:
    """The source side of the minimum cut of least ``tiebreak`` capacity: a cut is minimum iff
    no residual edge leaves its source side, so residual edges become uncuttable and every
    other edge costs its tiebreak (saturated edges; zero-capacity edges count as saturated)."""
    n = residual.shape[0]
    res = residual.tocoo()
    hard = (int(tiebreak.clip(min=0).sum()) + 1) if len(tiebreak) else 1
    if hard + res.nnz >= _LIMIT:
        return _closest_side(residual, s)
    rows = np.concatenate([src, res.row]).astype(np.int64)
    cols = np.concatenate([dst, res.col]).astype(np.int64)
    caps = np.concatenate([tiebreak.clip(min=0), np.full(res.nnz, hard)]).astype(np.int32)
    graph = csr_matrix((caps, (rows, cols)), shape=(n, n))
    graph.sum_duplicates()
    graph.data = np.minimum(graph.data, hard).astype(np.int32)
    flow = maximum_flow(graph, s, t, method="dinic").flow
    left = (graph - flow).tocsr()
    left.data[left.data < 0] = 0
    left.eliminate_zeros()
    return _closest_side(left, s)


def _closest_side(residual: csr_matrix, s: int) -> np.ndarray:
    side = np.zeros(residual.shape[0], dtype=bool)
    side[breadth_first_order(residual, s, directed=True, return_predecessors=False)] = True
    return side
