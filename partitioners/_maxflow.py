"""Minimum s-t cut with scipy's compiled max-flow (Dinic), on exact integer capacities.

Why this solver: ``scipy.sparse.csgraph.maximum_flow`` runs Dinic's algorithm in compiled code
on a CSR graph, which handles 100k-edge networks in milliseconds, where a pure-Python max-flow
(networkx, what torch's partitioner uses) spends most of a partition's time. Its catch: it
computes in int32 and silently returns garbage on larger int64 capacities. So capacities are
scaled here, never by the caller: divided by their gcd (tensor sizes share large power-of-two
factors), and, only if their sum still does not fit, rounded up to a coarser unit (the cut is
then optimal up to that rounding, and ``exact`` says so).
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
    num_nodes: int, src: Sequence[int], dst: Sequence[int], caps: Sequence[int], s: int, t: int
) -> Cut:
    """Minimum ``s``-``t`` cut of the network with edges ``src[i] -> dst[i]`` of ``caps[i]``
    (``INF`` for uncuttable). Parallel edges must already be merged by the caller.

    >>> cut = min_cut(4, [0, 1, 2, 0], [1, 2, 3, 2], [INF, 5, INF, 3], 0, 3)
    >>> cut.value, cut.source_side.tolist()
    (8, [True, True, False, False])
    """
    src_a, dst_a = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    real = np.asarray(caps, dtype=object)
    bound = _feasible_bound(num_nodes, src_a, dst_a, real, s, t)
    if bound is None:  # every cut crosses an uncuttable edge
        return Cut(np.zeros(num_nodes, dtype=bool), 0, True, False)
    for _ in range(3):  # a rounded solve still finds a cut, whose value is a tighter bound
        side, exact = _solve(num_nodes, src_a, dst_a, caps, s, t, bound)
        value = int(sum(int(c) for c in real[side[src_a] & ~side[dst_a]]))
        if exact or value >= bound:
            break
        bound = value
    return Cut(side, value, exact, True)


def _solve(
    n: int, src: np.ndarray, dst: np.ndarray, caps: Sequence[int], s: int, t: int, bound: int
) -> tuple[np.ndarray, bool]:
    """One max-flow at the scale ``bound`` allows; the smallest source side of a min cut."""
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
    return side, exact
