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
from typing import Any

import torch
import torch.fx as fx

__all__ = ["copy_module", "fast_target", "use_fast_calls"]

aten = torch.ops.aten
_T = torch.Tensor
# overload -> (binding, keyword arguments it accepts with the schema's meaning)
_FAST: dict[Any, tuple[Callable[..., Any], frozenset[str]]] = {
    aten.view.default: (_T.view, frozenset()),
    aten._unsafe_view.default: (_T.view, frozenset()),  # graphs are functional: aliasing is moot
    aten.t.default: (torch.t, frozenset()),
    aten.transpose.int: (torch.transpose, frozenset()),
    aten.permute.default: (torch.permute, frozenset()),
    aten.expand.default: (_T.expand, frozenset()),
    aten.unsqueeze.default: (torch.unsqueeze, frozenset()),
    aten.squeeze.dim: (torch.squeeze, frozenset()),
    aten.select.int: (torch.select, frozenset()),
    aten.mm.default: (torch.mm, frozenset()),
    aten.bmm.default: (torch.bmm, frozenset()),
    aten.addmm.default: (torch.addmm, frozenset({"beta", "alpha"})),
    aten.add.Tensor: (torch.add, frozenset({"alpha"})),
    aten.sub.Tensor: (torch.sub, frozenset({"alpha"})),
    aten.mul.Tensor: (torch.mul, frozenset()),
    aten.div.Tensor: (torch.div, frozenset()),
    aten.neg.default: (torch.neg, frozenset()),
    aten.exp.default: (torch.exp, frozenset()),
    aten.tanh.default: (torch.tanh, frozenset()),
    aten.where.self: (torch.where, frozenset()),
    aten.clone.default: (torch.clone, frozenset({"memory_format"})),
    aten.cat.default: (torch.cat, frozenset()),
}


def _has_dim(node: fx.Node) -> bool:
    """``sum``/``mean`` with ``dim=None`` mean "all dims" in ATen but not in every binding."""
    return len(node.args) > 1 and node.args[1] is not None


# ops whose binding only matches the overload under a condition on the node's arguments
_GUARDED: dict[Any, tuple[Callable[..., Any], frozenset[str], Callable[[fx.Node], bool]]] = {
    aten.sum.dim_IntList: (torch.sum, frozenset({"dtype"}), _has_dim),
    aten.mean.dim: (torch.mean, frozenset({"dtype"}), _has_dim),
}


def fast_target(target: Any, kwargs: Mapping[str, Any]) -> Callable[..., Any] | None:
    """The fast binding for ``target`` called with keyword arguments ``kwargs``, or None."""
    entry = _FAST.get(target)
    if entry is None or not set(kwargs) <= entry[1]:
        return None
    return entry[0]


def use_fast_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose common ATen calls go through torch's fast Python bindings."""
    gm = copy_module(gm)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        fast = fast_target(node.target, node.kwargs)
        guarded = _GUARDED.get(node.target)
        if guarded is not None and set(node.kwargs) <= guarded[1] and guarded[2](node):
            fast = guarded[0]
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
    return fx.GraphModule(gm, graph)
