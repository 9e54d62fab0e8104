"""Reductions read through reshapes: a pure pass run before fusion.

A backward graph sums bias gradients over ``grad.view(B * T, C)``: the reduction's input is a
reshape of a value computed in ``(B, T, C)``. A kernel maps each value dim onto one dim of its
iteration space, so the reshape separates the sum from the kernel computing ``grad``. Summing
``grad`` over ``(B, T)`` directly is the same reduction (a reshape only regroups consecutive
dims), and then one kernel computes ``grad``, stores it for the matmul and sums its columns.

>>> import torch, functrans as ft
>>> g = ft.trace(lambda x: (x * 2).view(6, 4).sum(0))(torch.ones(2, 3, 4))
>>> [str(n.args[1:]) for n in unview(g.graph_module).graph.nodes if n.op == "call_function"][-1]
'([0, 1], False)'
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx as fx

from functrans.codegen._fastcall import copy_module

from .layout import reduced_dims
from .traced import traced_value

__all__ = ["unview"]

aten = torch.ops.aten
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_REDUCTIONS = (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default)


class _DimGroup(NamedTuple):
    """Consecutive dims of a reshape's input (``src``) and output (``dst``) holding the same
    elements."""

    src: list[int]
    dst: list[int]


def _groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[_DimGroup] | None:
    """Consecutive dims of ``a`` and ``b`` with equal products: how a reshape regroups them."""
    groups: list[_DimGroup] = []
    i = j = 0
    while i < len(a) or j < len(b):
        ga, gb, pa, pb = [], [], 1, 1
        if i < len(a):
            ga, pa, i = [i], a[i], i + 1
        if j < len(b):
            gb, pb, j = [j], b[j], j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                ga, pa, i = [*ga, i], pa * a[i], i + 1
            elif pb < pa and j < len(b):
                gb, pb, j = [*gb, j], pb * b[j], j + 1
            else:
                return None
        groups.append(_DimGroup(ga, gb))
    return groups


def _through(r: fx.Node) -> list[int] | None:
    """The dims of the reshape's input that ``r`` reduces, when it reduces whole groups."""
    view = r.args[0]
    assert isinstance(view, fx.Node)
    src = view.args[0]
    a, b = tuple(traced_value(src).shape), tuple(traced_value(view).shape)
    groups = _groups(a, b)
    if groups is None:
        return None
    dims = reduced_dims(r, len(b)).dims
    out: list[int] = []
    for g in groups:
        hit = [d for d in g.dst if d in dims and b[d] != 1]
        if hit and len(hit) != len([d for d in g.dst if b[d] != 1]):
            return None  # part of a group: the sum splits what the reshape merged
        if hit:
            out += [d for d in g.src if a[d] != 1]
    return out or None


def unview(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with reductions of reshapes reading the reshape's input (a copy; ``gm`` itself
    when nothing changes)."""
    todo = [
        (n, dims)
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n.target in _REDUCTIONS
        and isinstance(n.args[0], fx.Node)
        and n.args[0].target in _RESHAPES
        and isinstance(n.args[0].args[0], fx.Node)
        and isinstance(traced_value(n), torch.Tensor)
        and (dims := _through(n)) is not None
    ]
    if not todo:
        return gm
    env: dict[fx.Node, fx.Node] = {}
    out = copy_module(gm, env)
    graph = out.graph
    for r0, dims in todo:
        r = env[r0]
        view = r.args[0]
        assert isinstance(view, fx.Node)
        src = view.args[0]
        with graph.inserting_before(r):
            s = graph.call_function(r.target, (src, dims, False), dict(r.kwargs))  # type: ignore[arg-type]  # fx's Argument type does not admit a tuple of Any
            s.meta = {**r.meta, "val": r.target(traced_value(src), dims, False, **r.kwargs)}  # type: ignore[operator]  # fx types target as str | Callable; here it is an op
            shape = list(traced_value(r).shape)
            if list(traced_value(s).shape) != shape:
                s = graph.call_function(aten.view.default, (s, shape))
                s.meta = {**r.meta, "val": traced_value(s.args[0]).view(shape)}
        r.replace_all_uses_with(s)
        graph.erase_node(r)
        if not view.users:
            graph.erase_node(view)
    out.recompile()
    return out
