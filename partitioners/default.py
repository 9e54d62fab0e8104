"""``"default"``: eager-like. Save every forward value the backward uses; recompute nothing.

The forward graph computes exactly what the outputs need; every value of it that a later
(backward-side) op reads is saved, as eager autograd's derivative formulas do.
"""

from __future__ import annotations

import torch.fx as fx

from functrans.extend import JointGraph, ancestors

from . import register

__all__ = ["default", "forward_core"]


def forward_core(joint: JointGraph) -> set[fx.Node]:
    """The nodes the forward outputs need: what an ordinary forward pass computes."""
    return ancestors(joint.forward_outputs(), set())


def default(joint: JointGraph) -> list[fx.Node]:
    """Save the forward-core values that any op outside the forward core reads.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: torch.tanh(x).sum())(torch.ones(3))
    >>> [n.name for n in default(jg)]
    ['tanh']
    """
    core = forward_core(joint)
    return [
        n
        for n in joint.fx_graph.nodes
        if n in core and any(u not in core and u.op != "output" for u in n.users)
    ]


register("default", default)
