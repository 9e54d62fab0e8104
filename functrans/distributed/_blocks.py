"""``jit_blocks``: each innermost FSDP unit's ``forward`` compiled, FSDP's hooks around it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from functrans._core.errors import InvalidArgumentError
from functrans._core.marks import leave, marked
from functrans._core.module_view import is_fsdp_module
from functrans._core.tags import PolicyLike
from functrans._jit.api import jit
from functrans._transforms.remat import remat

__all__ = ["JitBlock", "chosen_blocks", "compiled_forward", "fsdp_units", "jit_blocks"]


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
    ``blocks`` chooses the modules instead (each must be an FSDP unit or inside one). A
    ``peak_bytes`` would bound each block's own peak, not the step's: it is refused, naming
    :func:`~functrans.distributed.budget_blocks`, which budgets the step on every rank.

    The root unit's own code (embeddings, head, loss) stays eager: it calls the blocks, whose
    FSDP hooks all-gather outside any trace.

    >>> import torch
    >>> jit_blocks(torch.nn.Linear(2, 2))
    Traceback (most recent call last):
    ...
    functrans._core.errors.InvalidArgumentError: jit_blocks: Linear has no FSDP unit...
    """
    if "peak_bytes" in jit_options:
        raise InvalidArgumentError(
            f"jit_blocks: peak_bytes={jit_options['peak_bytes']!r} is not accepted: it would "
            "bound each block's own peak, not the step's, which FSDP's buffers dominate; use "
            "ft.distributed.budget_blocks(model, step, peak_bytes=...) for a step budget on "
            "each rank"
        )
    for block in chosen_blocks("jit_blocks", model, blocks):
        if marked(block, JitBlock):
            continue
        # the unit's own forward; FSDP's hooks stay around it
        block.forward = compiled_forward(block.forward, policy, jit_options)
        leave(block, JitBlock())
    return model


def chosen_blocks(
    where: str, model: torch.nn.Module, blocks: Sequence[torch.nn.Module] | None
) -> list[torch.nn.Module]:
    """``blocks``, or the innermost FSDP units of ``model``; an error naming ``where`` if none."""
    chosen = fsdp_units(model) if blocks is None else list(blocks)
    if not chosen:
        raise InvalidArgumentError(
            f"{where}: {type(model).__name__} has no FSDP unit; call "
            "torch.distributed.fsdp.fully_shard on each block (and the root) first, or pass "
            "blocks=[...]"
        )
    return chosen


def compiled_forward(
    body: Callable[..., Any], policy: PolicyLike | Literal[False], jit_options: dict[str, Any]
) -> Any:
    """``ft.jit`` of a block's ``forward`` (under ``ft.remat`` with ``policy`` unless False)."""
    if policy is not False:
        body = remat(body, policy=policy)
    return jit(body, **jit_options)
