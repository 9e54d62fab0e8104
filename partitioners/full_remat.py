"""``"full_remat"`` (alias ``"checkpoint"``): save only the primal inputs; backward recomputes
everything else, as ``torch.utils.checkpoint`` does.

Random ops are one exception: re-running one would draw new numbers, so the outputs of random
ops that backward needs are saved (torch's checkpoint replays RNG state instead). Values a remat
policy marked MUST_SAVE are the other: they are saved when backward needs them.
"""

from __future__ import annotations

import torch.fx as fx

from functrans.extend import JointGraph, OpClass, Policy, ancestors, op_class, policy_of

from . import register
from .default import forward_core

__all__ = ["full_remat"]


def full_remat(joint: JointGraph) -> list[fx.Node]:
    """Save nothing but random-op outputs backward needs; ``split`` adds the primals.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: torch.tanh(x).sum())(torch.ones(3))
    >>> full_remat(jg)
    []
    """
    core = forward_core(joint)
    keep = {n for n in core if op_class(n) is OpClass.RANDOM or policy_of(n) is Policy.MUST_SAVE}
    needed = ancestors(joint.grad_outputs(), set(joint.tangents()) | keep)
    return [n for n in joint.fx_graph.nodes if n in keep and n in needed]


register("full_remat", full_remat, aliases=("checkpoint",))
