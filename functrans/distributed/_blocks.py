"""functrans inside torch.distributed: FSDP2 (``fully_shard``) training with compiled blocks.

FSDP2 all-gathers each unit's parameters in a forward pre-hook and frees them after (with
``reshard_after_forward``), around the unit's ``forward``. Inside ``forward`` the parameters
are plain, unsharded tensors: that is where functrans compiles. :func:`jit_blocks` replaces the
``forward`` of every innermost FSDP unit (a transformer block, typically) by ``ft.jit`` of it
(optionally under a remat policy), leaving FSDP's hooks, collectives and optimizer state as
they are: losses and gradients equal eager FSDP2's.

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

from dataclasses import dataclass
from typing import Any, Literal

import torch

from ._core.errors import InvalidArgumentError
from ._core.marks import leave, marked
from ._core.module_view import is_fsdp_module as is_fsdp_module
from ._core.tags import PolicyLike
from ._jit.api import jit
from ._transforms.remat import remat

__all__ = ["fsdp_units", "is_fsdp_module", "jit_blocks"]


@dataclass(frozen=True)
class JitBlock:
    """The record :func:`jit_blocks` leaves on a block whose ``forward`` it compiled (a second
    ``jit_blocks`` leaves the block as it is)."""


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The innermost FSDP units of ``model`` (those without FSDP units below them), in module
    order: the blocks whose ``forward`` sees only unsharded, plain parameters."""
    units = [m for m in model.modules() if is_fsdp_module(m)]
    return [u for u in units if not any(is_fsdp_module(m) for m in list(u.modules())[1:])]


def jit_blocks(
    model: torch.nn.Module,
    *,
    policy: PolicyLike | Literal[False] = False,
    blocks: list[torch.nn.Module] | None = None,
    **jit_options: Any,
) -> torch.nn.Module:
    """Compile the ``forward`` of every innermost FSDP unit of ``model`` with ``ft.jit``
    (``jit_options``: ``partition``, ``backend``, strategy options), under
    ``ft.remat(..., policy=policy)`` unless ``policy`` is False; in place, returns ``model``.
    ``blocks`` chooses the modules instead (each must be an FSDP unit or inside one).

    The root unit's own code (embeddings, head, loss) stays eager: it calls the blocks, whose
    FSDP hooks all-gather outside any trace.

    >>> import torch
    >>> jit_blocks(torch.nn.Linear(2, 2))
    Traceback (most recent call last):
    ...
    functrans._core.errors.InvalidArgumentError: jit_blocks: Linear has no FSDP unit...
    """
    chosen = fsdp_units(model) if blocks is None else list(blocks)
    if not chosen:
        raise InvalidArgumentError(
            f"jit_blocks: {type(model).__name__} has no FSDP unit; call "
            "torch.distributed.fsdp.fully_shard on each block (and the root) first, or pass "
            "blocks=[...]"
        )
    for block in chosen:
        if marked(block, JitBlock):
            continue
        body = block.forward  # the unit's own forward; FSDP's hooks stay around it
        if policy is not False:
            body = remat(body, policy=policy)
        block.forward = jit(body, **jit_options)
        leave(block, JitBlock())
    return model
