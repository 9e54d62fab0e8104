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

import torch.fx as fx

from functrans.extend import cancelled_transposes, permutation

from ._fastcall import copy_module

__all__ = ["cancel_transposes", "permutation"]


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
        base = cancelled_transposes(node)
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
