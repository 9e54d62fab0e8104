"""A linear model of a training step's peak memory, for ``memory_budget(peak_bytes=...)``.

The step runs the forward graph, then the backward graph in the joint graph's backward order
with each recomputed value computed just before its first use (``split``'s schedule). Its live
bytes at each forward op and each backward op are a constant (what no decision changes:
values the forward computes and frees anyway, the outputs, the tangents, every gradient and
backward temporary) plus the bytes of the decided values alive then:

- a value *saved* is alive from the end of its forward life (its last forward use, or its
  creation for a value only backward reads) through backward until its last use ``last``;
- a value *recomputed* is alive from the start of its segment's backward (:mod:`the segment
  boundaries <functrans._cut.segments>` are saved, so recomputation never reaches across them)
  until ``last``;
- a value *offloaded* is on the device again from its first backward read until ``last``.

``last`` is the latest backward op that reads the value, or that may read a value computed
from it (a recomputed user needs it when it is recomputed). Each term is a bound the real
schedule meets or beats, so the model's peak is at least the simulated one, which is checked
after the solve (see :func:`functrans.partitioners.memory_budget`).

Each of the two passes is a chain of continuous variables ``L_t = L_(t-1) + (bytes starting
at t) - (bytes ending at t-1)`` (a few nonzeros per value, not one per value and time), and
``P >= L_t + constant_t`` for every t makes ``P`` the modelled peak.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.fx as fx
from scipy.sparse import coo_matrix

if TYPE_CHECKING:
    from scipy.optimize import LinearConstraint

from functrans.extend import (
    PHASE,
    SHARED,
    CutProblem,
    ForwardValue,
    Phase,
    Segments,
    is_input_alias,
    nbytes,
    scratch_bytes,
    segments,
    storage_of,
)

__all__ = ["SCALE", "Interval", "PeakModel", "peak_model"]

#: the unit of the model's variables: a MiB
SCALE = float(1 << 20)


def optimize() -> Any:  # scipy is untyped
    """``scipy.optimize``, imported when a plan first needs it: the import costs 0.4 s, which a
    process that never plans against a memory budget should not pay at its first partition
    (every built-in strategy's module is loaded then)."""
    import scipy.optimize

    return scipy.optimize


@dataclass(frozen=True)
class Interval:
    """``bytes`` alive from step ``start`` to step ``end`` (both included) of one pass when the
    decision variable ``kind`` (0 saved, 1 recomputed, 2 offloaded) of value ``value`` is 1."""

    value: int
    kind: int
    start: int
    end: int
    bytes: int


@dataclass(frozen=True)
class Scratch:
    """Values a recomputation makes and frees on the way (recomputed, read by no backward op),
    recomputed together right before backward op ``at`` runs: at most as many of them are
    alive at once as the forward held at any of its steps (their ``terms``, on the forward's
    time axis). A value is recomputed when backward first reads it or a value of its segment
    computed from it (a recomputed one: the model takes the earliest such read)."""

    terms: tuple[Interval, ...]
    at: int


@dataclass(frozen=True)
class PeakModel:
    """The peak of a step as linear terms over the ILP's decisions (see the module docstring).

    ``forward`` and ``backward`` are the constant live bytes after each op of each pass
    (``before``: entering each backward op, where recomputation runs);
    ``forward_terms`` and ``backward_terms`` the decided values' intervals; ``boundaries`` the
    values the model assumes saved (segment boundaries) and ``views`` the views it assumes not
    saved (their base is, where backward needs them: the same bytes, counted once).
    """

    forward: np.ndarray
    backward: np.ndarray
    #: the constant bytes entering each backward op (allocated before it, still needed)
    before: np.ndarray
    forward_terms: tuple[Interval, ...]
    backward_terms: tuple[Interval, ...]
    boundaries: frozenset[int]
    views: frozenset[int]
    scratch: tuple[Scratch, ...] = ()

    def constraints(
        self, width: int, n: int, kinds: int, limit: float
    ) -> tuple[list[LinearConstraint], int, int]:
        """Rows over ``x`` extended by this model's variables (the chains, then ``P``), which
        start at column ``width``; ``n`` values per decision kind, ``kinds`` kinds (2: saved
        and recomputed; 3: offloaded too). Returns the rows, the new width and ``P``'s column.
        ``P`` is bounded by ``limit``. The chains and ``P`` count :data:`SCALE` bytes (MiB), which
        keeps the coefficients near 1 where HiGHS' tolerances hold."""
        f, b = len(self.forward), len(self.backward)
        lf, lb = width, width + f
        scratch = lb + b  # per group: X_g, then its chain
        spans = [_span(g.terms) for g in self.scratch]
        cursor = scratch + len(self.scratch)
        chain_of = []
        for lo_t, hi_t in spans:
            chain_of.append(cursor - lo_t)
            cursor += hi_t - lo_t + 1
        peak = cursor
        total = peak + 1
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        lo: list[float] = []
        hi: list[float] = []

        def chain(base: int, times: range, terms: Sequence[Interval]) -> None:
            """L_t - L_(t-1) - starting + ending = 0 over ``times`` (columns ``base + t``)."""
            starts: dict[int, list[Interval]] = {}
            ends: dict[int, list[Interval]] = {}
            for term in terms:
                if term.kind < kinds:
                    starts.setdefault(term.start, []).append(term)
                    ends.setdefault(term.end, []).append(term)
            for t in times:
                r = len(lo)
                rows.append(r)
                cols.append(base + t)
                vals.append(1.0)
                if t > times.start:
                    rows.append(r)
                    cols.append(base + t - 1)
                    vals.append(-1.0)
                for term in starts.get(t, ()):
                    rows.append(r)
                    cols.append(term.kind * n + term.value)
                    vals.append(-term.bytes / SCALE)
                for term in ends.get(t - 1, ()):
                    rows.append(r)
                    cols.append(term.kind * n + term.value)
                    vals.append(term.bytes / SCALE)
                lo.append(0.0)
                hi.append(0.0)

        chain(lf, range(f), self.forward_terms)
        chain(lb, range(b), self.backward_terms)
        for g, (group, (lo_t, hi_t)) in enumerate(zip(self.scratch, spans, strict=True)):
            chain(chain_of[g], range(lo_t, hi_t + 1), group.terms)
            for t in range(lo_t, hi_t + 1):  # L_t - X_g <= 0
                r = len(lo)
                rows += [r, r]
                cols += [chain_of[g] + t, scratch + g]
                vals += [1.0, -1.0]
                lo.append(-np.inf)
                hi.append(0.0)
        for base, length, const in ((lf, f, self.forward), (lb, b, self.backward)):
            for t in range(length):  # L_t - P <= -constant_t
                r = len(lo)
                rows += [r, r]
                cols += [base + t, peak]
                vals += [1.0, -1.0]
                lo.append(-np.inf)
                hi.append(-float(const[t]) / SCALE)
        pulls: dict[int, list[int]] = {}
        for g, group in enumerate(self.scratch):
            pulls.setdefault(group.at, []).append(g)
        for t, groups in sorted(pulls.items()):  # L_t + X_g - P <= -before_t
            r = len(lo)
            rows += [r] * (2 + len(groups))
            cols += [lb + t, peak, *(scratch + g for g in groups)]
            vals += [1.0, -1.0, *([1.0] * len(groups))]
            lo.append(-np.inf)
            hi.append(-float(self.before[t]) / SCALE)
        a = coo_matrix((vals, (rows, cols)), shape=(len(lo), total)).tocsr()
        cons = [optimize().LinearConstraint(a, np.array(lo), np.array(hi))]
        bound = np.zeros(total)
        bound[peak] = 1.0
        cons.append(optimize().LinearConstraint(bound[None, :], -np.inf, limit / SCALE))
        return cons, total, peak

    def evaluate(self, chosen: Sequence[set[int]]) -> tuple[np.ndarray, np.ndarray]:
        """The modelled live bytes after each op of each pass when ``chosen[k]`` holds the
        values whose decision ``k`` (0 saved, 1 recomputed, 2 offloaded) is 1."""

        def live(const: np.ndarray, terms: Sequence[Interval]) -> np.ndarray:
            out = const.astype(float).copy()
            for term in terms:
                if term.kind < len(chosen) and term.value in chosen[term.kind]:
                    out[term.start : term.end + 1] += term.bytes
            return out

        forward = live(self.forward, self.forward_terms)
        backward = live(self.backward, self.backward_terms)
        entering = live(self.before, self.backward_terms)
        pulled = np.zeros(len(self.backward))
        for group in self.scratch:
            pulled[group.at] += live(np.zeros(len(self.forward)), group.terms).max(initial=0.0)
        return forward, np.maximum(backward, np.where(pulled > 0, entering + pulled, 0.0))


def peak_model(problem: CutProblem) -> PeakModel:
    """The :class:`PeakModel` of ``problem``'s joint graph."""
    joint = problem.joint
    seg = segments(joint)
    nodes = list(joint.fx_graph.nodes)
    fwd = [n for n in nodes if n.meta.get(PHASE) is Phase.FORWARD and n.op != "placeholder"]
    bwd = [n for n in nodes if n.meta.get(PHASE) is Phase.BACKWARD and n.op != "placeholder"]
    t_of = {n: t for t, n in enumerate(fwd)}
    tau_of = {n: t for t, n in enumerate(bwd)}
    core = {v.node for v in problem if v.in_forward}
    outputs = {o for o in joint.forward_outputs() if isinstance(o, fx.Node)}
    kept = {storage_of(o) for o in outputs}  # outputs: the caller keeps them to the end
    forward = np.zeros(len(fwd))
    out_bytes = 0
    last_fwd: dict[object, int] = {}  # the forward's last read of each core storage
    for n in fwd:
        if n in core:
            forward[t_of[n]] += scratch_bytes(n)
    for key, (size, made, end, _) in _storages([n for n in fwd if n in core], t_of).items():
        if key in kept:
            forward[made:] += size
            out_bytes += size
        else:
            forward[made : end + 1] += size
        last_fwd[key] = end
    # backward: its own values (gradients, temporaries), the tangents and the outputs
    grads = {storage_of(g) for g in joint.grad_outputs() if isinstance(g, fx.Node)}
    backward = np.full(len(bwd), float(out_bytes + sum(_bytes(t) for t in joint.tangents())))
    before = backward.copy()
    for n in bwd:
        backward[tau_of[n]] += scratch_bytes(n)
    for key, (size, made, end, _) in _storages(bwd, tau_of).items():
        stop = len(bwd) - 1 if key in grads else end
        backward[made : stop + 1] += size
        before[made + 1 : stop + 1] += size

    first_read, last_read = _reads(problem, tau_of)
    checkpoints = seg.checkpoints
    seg_of = _segment_of(problem, _merged(seg, checkpoints))
    lasting, earliest = _lasting(problem, first_read, last_read, seg_of)
    boundary = frozenset(problem.index[b] for b in checkpoints if b in problem)
    starts = _window_starts(problem, first_read, seg_of, boundary)
    forward_terms: list[Interval] = []
    backward_terms: list[Interval] = []
    scratch: dict[int, list[Interval]] = {}
    end_of_forward = len(fwd) - 1
    for v in problem:
        end = lasting[v.index]
        size = 0 if v.node in outputs else v.bytes
        if size == 0 or end < 0:
            continue  # free, an output (counted above), or never needed in backward
        if v.can_save:  # saved: after its forward life, then in backward until `end`
            made = t_of.get(v.node, end_of_forward)
            t0 = last_fwd.get(storage_of(v.node), made) + 1 if v.in_forward else made
            if t0 <= end_of_forward:
                forward_terms.append(Interval(v.index, 0, t0, end_of_forward, size))
            backward_terms.append(Interval(v.index, 0, 0, end, size))
        own = 0 if _aliases(v) else size  # a recomputed view is its base's
        k = seg_of.get(v.node, SHARED)
        if v.can_recompute and own and _transient(v, k, first_read):
            made = t_of[v.node]
            pulled = max(starts.get(k, 0), min(earliest[v.index], end))
            scratch.setdefault(pulled, []).append(
                Interval(v.index, 1, made, max(last_fwd.get(storage_of(v.node), made), made), own)
            )
        elif v.can_recompute and own:
            # recomputed no sooner than its segment's backward starts, nor before backward
            # first reads it or a value of its segment computed from it
            window = 0 if k == SHARED or not v.in_forward else starts.get(k, 0)
            start = max(window, earliest[v.index])
            backward_terms.append(Interval(v.index, 1, min(start, end), end, own))
        if v.can_offload:
            start = min(first_read.get(v.index, end), end)
            backward_terms.append(Interval(v.index, 2, start, end, size))
    views = frozenset(v.index for v in problem if _saved_as_base(problem, v))
    groups = tuple(Scratch(tuple(terms), t) for t, terms in sorted(scratch.items()))
    return PeakModel(
        forward,
        backward,
        before,
        tuple(forward_terms),
        tuple(backward_terms),
        boundary,
        views,
        groups,
    )


def _transient(v: ForwardValue, segment: int, first: Mapping[int, int]) -> bool:
    """A value recomputation makes and frees on the way: computed by the forward, in a
    segment, read by no backward op."""
    return v.in_forward and segment != SHARED and v.index not in first


def _span(terms: Sequence[Interval]) -> tuple[int, int]:
    return min(t.start for t in terms), max(t.end for t in terms)


def _aliases(v: ForwardValue) -> bool:
    """A view (or ``_unsafe_view``): it lives in another value's storage."""
    root, part = v.storage
    return root is not v.node and part is None


def _saved_as_base(problem: CutProblem, v: ForwardValue) -> bool:
    """A view whose base may be saved: saving the base and re-viewing it costs the same."""
    root, index = storage_of(v.node)
    return (
        _aliases(v)
        and v.can_recompute
        and v.bytes > 0
        and index is None
        and root in problem
        and problem[root].can_save
    )


def _storages(
    nodes: Sequence[fx.Node], time: Mapping[fx.Node, int]
) -> dict[object, tuple[int, int, int, fx.Node | None]]:
    """The storages ``nodes`` allocate (inputs and views of them aside): per storage its
    bytes, the step that allocates it, the last step that reads it (through any view), and the
    node that holds it (None for an output of a multi-output op no one reads)."""
    out: dict[object, tuple[int, int, int, fx.Node | None]] = {}
    for n in nodes:
        val = n.meta.get("val")
        if isinstance(val, (tuple, list)):  # one storage per output, made by this op
            for i, v in enumerate(val):
                if isinstance(v, torch.Tensor):
                    out[(n, i)] = (nbytes(v), time[n], time[n], None)
            continue
        key = storage_of(n)
        if is_input_alias(n) or not isinstance(val, torch.Tensor):
            continue
        if key in out:
            size, made, end, holder = out[key]
            out[key] = (size, made, end, holder or n)
        elif key[0] is n or key[0] in time:
            out[key] = (nbytes(val), time.get(key[0], time[n]), time[n], n)
    for n in nodes:
        for a in n.all_input_nodes:
            key = storage_of(a)
            if key in out:
                size, made, end, holder = out[key]
                out[key] = (size, made, max(end, time[n]), holder)
    return out


def _bytes(node: fx.Node) -> int:
    return nbytes(node.meta.get("val"))


def _reads(
    problem: CutProblem, tau_of: dict[fx.Node, int]
) -> tuple[dict[int, int], dict[int, int]]:
    """First and last backward op reading each value directly, or reading a view of it (the
    view's storage is the value's)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}

    def read(i: int, t: int) -> None:
        first[i] = min(first.get(i, t), t)
        last[i] = max(last.get(i, t), t)

    grads = {g for g in problem.joint.grad_outputs() if isinstance(g, fx.Node)}
    for v in problem:
        times = [tau_of[u] for u in v.node.users if u in tau_of]
        if v.node in grads:
            times.append(len(tau_of) - 1)
        root = storage_of(v.node)[0]
        owner = problem.index.get(root) if root is not v.node else None
        for t in times:
            read(v.index, t)
            if owner is not None:
                read(owner, t)
    return first, last


def _merged(seg: Segments, kept: Sequence[fx.Node]) -> dict[fx.Node, int]:
    """Segment indices with the segments between kept boundaries merged: a value's new index
    is the number of kept boundaries before it (a kept boundary closes its segment)."""
    at = {b: i for i, b in enumerate(seg.boundaries)}
    closes = sorted(at[b] for b in kept)
    out = {}
    for n, k in seg.index.items():
        out[n] = SHARED if k == SHARED else bisect.bisect_left(closes, k)
    return out


def _segment_of(problem: CutProblem, index: Mapping[fx.Node, int]) -> dict[fx.Node, int]:
    """The segment of every value: core values by :func:`functrans.extend.segments`; a value
    only backward reads (a transpose, a cast for a gradient) by its storage's owner or, if it
    has its own, the latest segment among its inputs."""
    out = dict(index)
    for v in problem:
        if v.node in out:
            continue
        root = storage_of(v.node)[0]
        if root is not v.node and root in out:
            out[v.node] = out[root]
            continue
        ins = [out[a] for a in v.node.all_input_nodes if a in out and out[a] != SHARED]
        out[v.node] = max(ins) if ins else SHARED
    return out


def _lasting(
    problem: CutProblem,
    first: dict[int, int],
    last: dict[int, int],
    index: Mapping[fx.Node, int],
) -> tuple[list[int], list[int]]:
    """Per value, the latest backward op that may need it (-1: none) and the earliest.

    The latest is its last direct read, or a later time a forward user computed from it may be
    recomputed at (that user's first read; for a user backward never reads directly, the same
    bound of its own users): a recomputed user needs it then. The earliest is its first direct
    read or the earliest of its users' in its segment (recomputation starts from saved
    boundaries, so a read in another segment never pulls it)."""
    n = len(problem)
    users: list[list[int]] = [[] for _ in range(n)]
    for v in problem:
        for i in v.inputs:
            users[i].append(v.index)
    recomputed_by = [-1] * n  # the latest time a value may be recomputed at
    lasting = [-1] * n
    earliest = [_NEVER] * n
    seg = [index.get(v.node, SHARED) for v in problem]
    for v in reversed(problem.values):
        i = v.index
        later = max((recomputed_by[u] for u in users[i]), default=-1)
        recomputed_by[i] = first.get(i, later)
        lasting[i] = max(last.get(i, -1), later)
        near = [earliest[u] for u in users[i] if seg[i] in (SHARED, seg[u])]
        earliest[i] = min([first.get(i, _NEVER), *near])
    for v in problem:  # a multi-output op makes all its outputs when the first is needed
        root, part = v.storage
        if part is not None and root in problem.index:
            earliest[v.index] = earliest[problem.index[root]]
    return lasting, earliest


_NEVER = 1 << 40


def _window_starts(
    problem: CutProblem,
    first: dict[int, int],
    index: Mapping[fx.Node, int],
    boundary: frozenset[int],
) -> dict[int, int]:
    """Each segment's first backward read of one of its values (boundaries and their views
    aside: the next segment reads them)."""
    starts: dict[int, int] = {}
    for k, t in _segment_reads(problem, first, index, boundary):
        starts[k] = min(starts.get(k, t), t)
    return starts


def _segment_reads(
    problem: CutProblem,
    first: dict[int, int],
    index: Mapping[fx.Node, int],
    boundary: frozenset[int],
) -> list[tuple[int, int]]:
    """(segment, first backward read) of every value a segment's backward reads."""
    out = []
    for v in problem:
        if v.index in boundary or v.index not in first:
            continue
        root = storage_of(v.node)[0]
        if root in problem and problem.index[root] in boundary:
            continue
        k = index.get(v.node, SHARED)
        if k != SHARED:
            out.append((k, first[v.index]))
    return out
