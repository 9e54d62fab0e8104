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

from ._fastcall import copy_module

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
    """``gm`` without transpose pairs that cancel: a rewritten copy, or ``gm`` itself (never
    changed) where no pair cancels, as in most forward graphs (a copy of every graph was a
    16-block step's largest graph copy at compile time).

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x: x.exp() * 2)(torch.ones(2, 3))
    >>> cancel_transposes(g.graph_module) is g.graph_module
    True
    """
    outputs = set(next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes)
    same: dict[fx.Node, fx.Node] = {}  # a node -> the earlier value it equals
    for node in gm.graph.nodes:
        base = _cancelled(node)
        if base is None:
            continue
        base = same.get(base, base)  # t(t(t(t(x)))): x, through the pair below
        if base.op == "placeholder" and node in outputs:
            continue  # an output must not be an input itself
        same[node] = base
    if not same:
        return gm
    env: dict[fx.Node, fx.Node] = {}
    out = copy_module(gm, env)
    for node, base in same.items():
        env[node].replace_all_uses_with(env[base])
    out.graph.eliminate_dead_code()
    out.recompile()
    return out


def _cancelled(node: fx.Node) -> fx.Node | None:
    """What ``node`` reads back unchanged through a transpose pair that cancels (None: it
    does not)."""
    outer = permutation(node) if node.op == "call_function" else None
    inner_node = node.args[0] if outer is not None else None
    if outer is None or not isinstance(inner_node, fx.Node):
        return None
    inner = permutation(inner_node) if inner_node.op == "call_function" else None
    if inner is None or len(inner) != len(outer):
        return None
    if [inner[o] for o in outer] != list(range(len(outer))):
        return None
    base = inner_node.args[0]
    assert isinstance(base, fx.Node)
    return base
