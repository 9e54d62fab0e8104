"""Call common ATen ops through torch's Python bindings instead of their ``OpOverload`` s.

``torch.ops.aten.view.default(x, s)`` parses its arguments generically from the schema, which
costs a few microseconds more per call than ``torch.Tensor.view(x, s)`` with its generated
argument parser. On small tensors that difference is a large part of a graph's run time, so the
``"aten"`` backend rewrites the targets of these ops before running a graph. Each entry below
names exactly one overload and a binding that dispatches to that same overload for every
argument the graph can pass (positional arguments, plus the keyword-only ones listed), so
results are bit for bit those of the ``OpOverload``.

>>> import torch
>>> fast_target(torch.ops.aten.mm.default, {})
<built-in method mm of type object at ...>
>>> fast_target(torch.ops.aten.mm.default, {"out": None}) is None  # kwargs it doesn't take
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

__all__ = ["copy_module", "fast_target", "use_fast_calls"]

aten = torch.ops.aten
_T = torch.Tensor


class _Binding(NamedTuple):
    """A fast Python binding of an overload, and the keyword arguments it accepts with the
    schema's meaning."""

    fn: Callable[..., Any]
    kwargs: frozenset[str] = frozenset()


class _Guarded(NamedTuple):
    """A binding that matches its overload only where ``applies(node)``."""

    binding: _Binding
    applies: Callable[[fx.Node], bool]


_FAST: dict[Any, _Binding] = {
    aten.view.default: _Binding(_T.view),
    aten._unsafe_view.default: _Binding(_T.view),  # graphs are functional: aliasing is moot
    aten.t.default: _Binding(torch.t),
    aten.transpose.int: _Binding(torch.transpose),
    aten.permute.default: _Binding(torch.permute),
    aten.expand.default: _Binding(_T.expand),
    aten.unsqueeze.default: _Binding(torch.unsqueeze),
    aten.squeeze.dim: _Binding(torch.squeeze),
    aten.select.int: _Binding(torch.select),
    aten.mm.default: _Binding(torch.mm),
    aten.bmm.default: _Binding(torch.bmm),
    aten.addmm.default: _Binding(torch.addmm, frozenset({"beta", "alpha"})),
    aten.add.Tensor: _Binding(torch.add, frozenset({"alpha"})),
    aten.sub.Tensor: _Binding(torch.sub, frozenset({"alpha"})),
    aten.mul.Tensor: _Binding(torch.mul),
    aten.div.Tensor: _Binding(torch.div),
    aten.neg.default: _Binding(torch.neg),
    aten.exp.default: _Binding(torch.exp),
    aten.tanh.default: _Binding(torch.tanh),
    aten.where.self: _Binding(torch.where),
    aten.clone.default: _Binding(torch.clone, frozenset({"memory_format"})),
    aten.cat.default: _Binding(torch.cat),
}


def _has_dim(node: fx.Node) -> bool:
    """``sum``/``mean`` with ``dim=None`` mean "all dims" in ATen but not in every binding."""
    return len(node.args) > 1 and node.args[1] is not None


# ops whose binding only matches the overload under a condition on the node's arguments
_GUARDED: dict[Any, _Guarded] = {
    aten.sum.dim_IntList: _Guarded(_Binding(torch.sum, frozenset({"dtype"})), _has_dim),
    aten.mean.dim: _Guarded(_Binding(torch.mean, frozenset({"dtype"})), _has_dim),
}


def fast_target(target: Any, kwargs: Mapping[str, Any]) -> Callable[..., Any] | None:
    """The fast binding for ``target`` called with keyword arguments ``kwargs``, or None."""
    entry = _FAST.get(target)
    if entry is None or not set(kwargs) <= entry.kwargs:
        return None
    return entry.fn


def use_fast_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose common ATen calls go through torch's fast Python bindings."""
    gm = copy_module(gm)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        fast = fast_target(node.target, node.kwargs)
        guarded = _GUARDED.get(node.target)
        if (
            guarded is not None
            and set(node.kwargs) <= guarded.binding.kwargs
            and guarded.applies(node)
        ):
            fast = guarded.binding.fn
        if fast is not None:
            node.target = fast
    gm.recompile()
    return gm


def copy_module(gm: fx.GraphModule, env: dict[fx.Node, fx.Node] | None = None) -> fx.GraphModule:
    """A copy of ``gm`` whose graph can be rewritten without touching ``gm``'s; ``env``, when
    given, is filled with each node of ``gm`` and its copy."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {} if env is None else env)
    graph.output(out)
    return _LazyGraphModule(gm, graph)  # its code is generated once, after the rewrites
