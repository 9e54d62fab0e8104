"""``"default"``: eager-like. Save every forward value the backward uses; recompute nothing.

The forward graph computes exactly what the outputs need; every value of it that a later
(backward-side) op reads is saved, as eager autograd's derivative formulas do.
"""

from __future__ import annotations

import torch.fx as fx

from functrans.extend import JointGraph, OpClass, Policy, ancestors, op_class, policy_of

from . import register

__all__ = ["default", "forward_core"]


def forward_core(joint: JointGraph) -> set[fx.Node]:
    """The nodes the forward outputs need: what an ordinary forward pass computes."""
    return ancestors(joint.forward_outputs(), set())


def default(joint: JointGraph) -> list[fx.Node]:
    """Save the forward-core values that any op outside the forward core reads. A value a remat
    policy marked MUST_RECOMPUTE is not saved: its inputs are, and backward recomputes it.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: torch.tanh(x).sum())(torch.ones(3))
    >>> [n.name for n in default(jg)]
    ['tanh']
    """
    core = forward_core(joint)
    wanted = {n for n in core if any(u not in core and u.op != "output" for u in n.users)}
    keep = honor_recompute_tags(wanted)
    return [n for n in joint.fx_graph.nodes if n in keep]


def honor_recompute_tags(saved: set[fx.Node]) -> set[fx.Node]:
    """Replace every MUST_RECOMPUTE value (random ops excepted: they are never recomputed) by
    its inputs, transitively, so that backward recomputes it from what is saved."""
    out: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    todo = list(saved)
    while todo:
        n = todo.pop()
        if n in seen:  # residual connections: many paths reach the same node
            continue
        seen.add(n)
        if policy_of(n) is Policy.MUST_RECOMPUTE and op_class(n) is not OpClass.RANDOM:
            todo.extend(n.all_input_nodes)
        else:
            out.add(n)
    return out


register("default", default)
