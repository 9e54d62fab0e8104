"""``"default"``: eager-like. Save every forward value the backward uses; recompute nothing.

The forward graph computes exactly what the outputs need; every value of it that a later
(backward-side) op reads is saved, as eager autograd's derivative formulas do. Remat tags and
random ops are handled by the shared rules (:meth:`functrans.extend.CutProblem.legalize`): a
value that may not be saved is recomputed from its inputs, and so is one a policy would rather
recompute (PREFER_RECOMPUTE, as eager selective checkpointing and torch's default partition
treat it).
"""

from __future__ import annotations

import torch.fx as fx

from functrans.extend import ForwardValue, JointGraph, Policy, cut_problem

from . import register

__all__ = ["default"]


def default(joint: JointGraph) -> list[fx.Node]:
    """Save the forward values that any op the forward pass does not run reads.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: torch.tanh(x).sum())(torch.ones(3))
    >>> [n.name for n in default(jg)]
    ['tanh']
    """
    problem = cut_problem(joint)
    core = {v.node for v in problem if v.in_forward}
    wanted = [n for n in core if any(u not in core and u.op != "output" for u in n.users)]
    return problem.legalize(wanted, recompute=_prefers_recompute)


def _prefers_recompute(value: ForwardValue) -> bool:
    return value.tag is Policy.PREFER_RECOMPUTE


register("default", default, local=True)
