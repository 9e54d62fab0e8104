"""Drop transposes that undo each other before the ``"aten"`` backend runs a graph.

Autograd formulas transpose what the forward transposed: a linear layer's backward computes
``t(t(w))`` to get ``w`` back, and ``t(mm(...))`` only to transpose it again. Each such call
costs a Python-level dispatch and returns a tensor with the very strides it started from, so
``t(t(x))``, ``transpose(transpose(x, a, b), a, b)`` and permutes that compose to the identity
are replaced by ``x``.

>>> import torch, functrans as ft
>>> g = ft.trace(lambda x: x.t().t() * 2)(torch.ones(2, 3))
>>> [n.target for n in cancel_transposes(g.graph_module).graph.nodes if n.op == "call_function"]
[<OpOverload(op='aten.mul', overload='Tensor')>]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

__all__ = ["cancel_transposes", "permutation"]

aten = torch.ops.aten


def permutation(node: fx.Node) -> list[int] | None:
    """The dim permutation a transposing node applies, or None."""
    val = node.meta.get("val")
    rank = val.dim() if isinstance(val, torch.Tensor) else None
    if rank is None:
        return None
    if node.target is aten.t.default:
        return [1, 0] if rank == 2 else list(range(rank))
    if node.target is aten.transpose.int:
        dims: Any = node.args[1:3]
        a, b = (int(d) % max(rank, 1) for d in dims)
        p = list(range(rank))
        p[a], p[b] = p[b], p[a]
        return p
    if node.target is aten.permute.default:
        order: Any = node.args[1]
        return [int(d) % max(rank, 1) for d in order]
    return None


def cancel_transposes(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (changed in place and returned) without transpose pairs that cancel."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    changed = False
    for node in list(gm.graph.nodes):
        outer = permutation(node) if node.op == "call_function" else None
        inner_node = node.args[0] if outer is not None else None
        if outer is None or not isinstance(inner_node, fx.Node):
            continue
        inner = permutation(inner_node) if inner_node.op == "call_function" else None
        if inner is None or len(inner) != len(outer):
            continue
        if [inner[o] for o in outer] != list(range(len(outer))):
            continue
        base = inner_node.args[0]
        assert isinstance(base, fx.Node)
        if base.op == "placeholder" and node in output.all_input_nodes:
            continue  # an output must not be an input itself
        node.replace_all_uses_with(base)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm
