"""``"full_remat"`` (alias ``"checkpoint"``): save only the primal inputs; backward recomputes
everything else, as ``torch.utils.checkpoint`` does.

The shared rules make the exceptions (:meth:`functrans.extend.CutProblem.legalize`): random ops
never re-run, so the outputs of random ops that backward needs are saved (torch's checkpoint
replays RNG state instead), and so are values a remat policy marked MUST_SAVE.
"""

from __future__ import annotations

import torch.fx as fx

from functrans.extend import JointGraph, cut_problem

from . import register

__all__ = ["full_remat"]


def full_remat(joint: JointGraph) -> list[fx.Node]:
    """Save nothing but what may not be recomputed; ``split`` adds the primals.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: torch.tanh(x).sum())(torch.ones(3))
    >>> full_remat(jg)
    []
    """
    return cut_problem(joint).legalize([])


register("full_remat", full_remat, aliases=("checkpoint",), local=True)
