"""Where the values of a fused region live in its iteration space.

A kernel iterates over one shape, ``space``, reducing the dims ``rdims``. Each member's output
dims are mapped onto space dims (its ``fdims``; ``None`` for size-1 dims). The maps follow from
the ops themselves: a pointwise op's operand dims line up with its output dims by broadcasting
(right-aligned), a view that only adds or drops size-1 dims keeps its non-1 dims in order, a
reduction drops (or keeps as size 1) the dims it reduces. So fixing one node's map fixes every
node connected to it; :func:`layout` propagates from an anchor (a node spanning the whole
space) along these links in both directions and fails when two links disagree -- e.g. a
per-channel value would have to index two different dims.

>>> import torch, functrans as ft
>>> g = ft.trace(lambda x, s: x * s.unsqueeze(-1))(torch.ones(2, 3, 4), torch.ones(3))
>>> nodes = list(g.ops())
>>> lay = layout(nodes)
>>> lay.space, lay.rdims, [lay.fdims[n] for n in nodes]
((2, 3, 4), frozenset(), [(1, None), (0, 1, 2)])
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from .lowering import LOWERINGS, REDUCTIONS
from .traced import first_output

__all__ = [
    "FDims",
    "Layout",
    "Link",
    "Reduced",
    "layout",
    "links",
    "operand_fdims",
    "reduced_dims",
    "shape",
]

FDims = tuple[int | None, ...]
"""A value's dim map: for each of its dims, the space dim it indexes (None: a size-1 dim)."""


@dataclass(frozen=True)
class Layout:
    """Where the values of nodes fused together live: the iteration ``space``, the space dims
    ``rdims`` it reduces, and each node's dim map ``fdims``."""

    space: tuple[int, ...]
    rdims: frozenset[int]
    fdims: dict[fx.Node, FDims]


def shape(node: fx.Node) -> tuple[int, ...]:
    """The (first) output shape of ``node``."""
    return tuple(int(s) for s in first_output(node).shape)


class Reduced(NamedTuple):
    """The (sorted) ``dims`` of its input a reduction reduces, and whether it keeps them."""

    dims: list[int]
    keepdim: bool


def reduced_dims(node: fx.Node, rank: int) -> Reduced:
    """What a reduction node reduces of its ``rank`` -dim input.

    >>> import functrans as ft
    >>> g = ft.trace(lambda x: x.sum(-1, keepdim=True))(torch.ones(2, 3))
    >>> reduced_dims(next(g.ops()), 2)
    Reduced(dims=[1], keepdim=True)
    """
    pos = REDUCTIONS[node.target].dim_arg
    dims: Any = node.args[pos] if 0 <= pos < len(node.args) else node.kwargs.get("dim")
    keep = node.args[pos + 1] if 0 <= pos < len(node.args) - 1 else False
    keepdim = bool(node.kwargs.get("keepdim", keep))
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return Reduced(list(range(rank)), keepdim)
    if isinstance(dims, int):
        dims = [dims]
    if rank == 0:  # a 0-dim tensor: dim 0 / -1 name the tensor itself, nothing to reduce
        return Reduced([], keepdim)
    return Reduced(sorted({d % rank for d in dims}), keepdim)


def _is_squeeze_view(n: fx.Node) -> bool:
    low = LOWERINGS.get(n.target)
    return (
        low is not None and low.kind == "reshape" and n.target is not torch.ops.aten.expand.default
    )


class Link(NamedTuple):
    """A dim of a value read (``src``) and a dim of its reader (``dst``) that index the same
    space dim."""

    src: int
    dst: int


def links(a: fx.Node, n: fx.Node) -> list[Link] | None:
    """The dims of ``a`` and of ``n`` that index the same space dim when ``n`` reads ``a``
    (non-1 dims only); None when the read cannot be expressed by index bookkeeping.

    >>> import functrans as ft
    >>> g = ft.trace(lambda x: x.sum(0))(torch.ones(2, 3))
    >>> x, total = next(iter(g.graph_module.graph.nodes)), next(g.ops())
    >>> links(x, total)
    [Link(src=1, dst=0)]
    """
    out, a_shape = shape(n), shape(a)
    if n.target is operator.getitem:
        return [Link(d, d) for d, s in enumerate(out) if s != 1]
    if n.target in REDUCTIONS:
        if a is not n.args[0]:
            return None
        reduced = reduced_dims(n, len(a_shape))
        pairs, j = [], 0
        for d, s in enumerate(a_shape):
            if d in reduced.dims:
                j += reduced.keepdim
                continue
            if s != 1:
                pairs.append(Link(d, j))
            j += 1
        return pairs
    if LOWERINGS[n.target].kind == "concat":  # same dims; reads shift along the concat dim
        return [Link(d, d) for d, s in enumerate(a_shape) if s != 1 or out[d] != 1]
    if _is_squeeze_view(n):
        a_non1 = [d for d, s in enumerate(a_shape) if s != 1]
        o_non1 = [d for d, s in enumerate(out) if s != 1]
        if [a_shape[d] for d in a_non1] != [out[d] for d in o_non1]:
            return None
        return [Link(da, dn) for da, dn in zip(a_non1, o_non1, strict=True)]
    off = len(out) - len(a_shape)
    pairs = [Link(ja, ja + off) for ja, s in enumerate(a_shape) if s != 1]
    if any(j < 0 or out[j] != a_shape[ja] for ja, j in pairs):
        return None
    return pairs


def _align(dims: Sequence[int], space: Sequence[int], known: list[int | None]) -> bool:
    """Right-align the unknown non-1 dims of shape ``dims`` to ``space``, in place."""
    used = {k for k in known if k is not None}
    off = len(space) - len(dims)
    for j, s in enumerate(dims):
        if known[j] is not None or s == 1:
            continue
        d = j + off
        if d < 0 or space[d] != s or d in used:
            return False
        known[j] = d
        used.add(d)
    return True


def layout(nodes: Sequence[fx.Node]) -> Layout | None:
    """The iteration space, reduced dims and dim maps of ``nodes`` fused together, or None."""
    members = set(nodes)
    reductions = [n for n in nodes if n.target in REDUCTIONS]
    if reductions:
        space = shape(reductions[0].args[0])  # type: ignore[arg-type]  # fx types args as Argument; here it is a Node
    else:
        space = max((shape(n) for n in nodes), key=math.prod)
    part: dict[fx.Node, list[int | None]] = {n: [None] * len(shape(n)) for n in nodes}
    for r in reductions:  # a reduction of an outside value: its output dims follow its input's
        src = r.args[0]
        if isinstance(src, fx.Node) and src not in members:
            fa: list[int | None] = [None] * len(shape(src))
            if _align(shape(src), space, fa):
                for da, dr in links(src, r) or []:
                    part[r][dr] = fa[da]
    seen: set[fx.Node] = set()
    anchored = [n for n in nodes if any(d is not None for d in part[n])]
    for start in anchored + sorted(nodes, key=lambda n: shape(n) != space):
        if start in seen:
            continue
        if not _align(shape(start), space, part[start]):
            return None
        if not _propagate(start, members, part, seen):
            return None
    fd: dict[fx.Node, FDims] = {}
    for n in nodes:
        dims = shape(n)
        if not _align(dims, space, part[n]):
            return None
        got = [k for k in part[n] if k is not None]
        if len(set(got)) != len(got):
            return None
        fd[n] = tuple(part[n])
    concat = any(n.target in LOWERINGS and LOWERINGS[n.target].kind == "concat" for n in nodes)
    if concat and reductions:  # shifted reads are rendered straight-line only
        return None
    rdims = _rdims(reductions, members, fd, space)
    return None if rdims is None else Layout(space, rdims, fd)


def _propagate(
    start: fx.Node,
    members: set[fx.Node],
    part: dict[fx.Node, list[int | None]],
    seen: set[fx.Node],
) -> bool:
    """Spread ``start`` 's dim map over its connected members; False on a contradiction."""
    queue = [start]
    seen.add(start)
    while queue:
        u = queue.pop()
        edges = [(u, n) for n in u.users if n in members]
        edges += [(a, u) for a in u.all_input_nodes if a in members]
        for a, n in edges:
            pairs = links(a, n)
            concat = n.target in LOWERINGS and LOWERINGS[n.target].kind == "concat"
            if pairs is None or concat:  # a concat reads its operands at shifted indices
                return False
            for da, dn in pairs:
                src, dst, i, j = (a, n, da, dn) if a is u else (n, a, dn, da)
                have, want = part[dst][j], part[src][i]
                if want is None:
                    continue
                if have is None:
                    part[dst][j] = want
                    if dst not in seen:
                        seen.add(dst)
                        queue.append(dst)
                elif have != want:
                    return False
            other = n if a is u else a
            if other not in seen:
                seen.add(other)
                queue.append(other)
    return True


def _rdims(
    reductions: list[fx.Node], members: set[fx.Node], fd: dict[fx.Node, FDims], space: Any
) -> frozenset[int] | None:
    """The space dims every reduction reduces (all must agree), or None."""
    rdims: set[int] | None = None
    for r in reductions:
        src = r.args[0]
        assert isinstance(src, fx.Node)
        a_shape = shape(src)
        if src in members:
            fa: list[int | None] = list(fd[src])
        else:
            got = operand_fdims(src, r, fd[r], space)
            if got is None:
                return None
            fa = list(got)
        dims = reduced_dims(r, len(a_shape)).dims
        mapped = {fa[d] for d in dims if a_shape[d] != 1}
        if None in mapped or (rdims is not None and mapped != rdims):
            return None
        rdims = {m for m in mapped if m is not None}
    return frozenset(rdims or ())


def operand_fdims(a: fx.Node, n: fx.Node, fd_n: FDims, space: Sequence[int]) -> FDims | None:
    """The dim map of a value ``a`` from outside the region, as ``n`` (map ``fd_n``) reads
    it: linked dims follow ``n``; the rest (a reduction's reduced dims) right-align to space."""
    fa: list[int | None] = [None] * len(shape(a))
    for da, dn in links(a, n) or []:
        fa[da] = fd_n[dn]
    return tuple(fa) if _align(shape(a), space, fa) else None
