"""functrans inside torch.distributed: FSDP2 (``fully_shard``) training with compiled blocks.

FSDP2 all-gathers each unit's parameters in a forward pre-hook and frees them after (with
``reshard_after_forward``), around the unit's ``forward``. Inside ``forward`` the parameters
are plain, unsharded tensors: that is where functrans compiles. :func:`jit_blocks` replaces the
``forward`` of every innermost FSDP unit (a transformer block, typically) by ``ft.jit`` of it
(optionally under a remat policy), leaving FSDP's hooks, collectives and optimizer state as
they are: losses and gradients equal eager FSDP2's. :func:`budget_blocks` compiles the same
blocks with a cut each, chosen so that the user's training step peaks within a byte limit on
every rank: measured, since FSDP2's own buffers (gathered parameters, gradient buffers, a
collective's buffer freed late by its worker thread) are most of that peak.

Inside a traced graph, torch.distributed's functional collectives are a class of their own
(:attr:`functrans.extend.OpClass.COLLECTIVE`): never recomputed, merged or dropped by any
strategy or pass unless a remat policy tags them (:func:`functrans.policies.reshard_after_forward`),
so every rank issues the same collectives whatever its local shapes.

>>> import torch
>>> from functrans.distributed import fsdp_units
>>> fsdp_units(torch.nn.Linear(2, 2))  # no fully_shard: no units
[]
"""

from __future__ import annotations

from functrans._core.module_view import is_fsdp_module as is_fsdp_module

from ._blocks import JitBlock, fsdp_units, jit_blocks
from ._budget import CUTS, StepBudget, Trial, budget_blocks

__all__ = [
    "CUTS",
    "JitBlock",
    "StepBudget",
    "Trial",
    "budget_blocks",
    "fsdp_units",
    "is_fsdp_module",
    "jit_blocks",
]
