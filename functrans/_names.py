"""``checkpoint_name(x, name)``: an identity that names a value for name-based remat policies.

It is a real op (``functrans::checkpoint_name``) so that it shows up both to eager dispatch
modes and in traced graphs, where policies see it with its name.
"""

from __future__ import annotations

import functools
from typing import Any

import optree
import torch

from ._pytree import NAMESPACE

__all__ = ["checkpoint_name", "checkpoint_name_op"]


@functools.cache
def checkpoint_name_op() -> Any:
    @torch.library.custom_op("functrans::checkpoint_name", mutates_args=())
    def name_op(x: torch.Tensor, name: str) -> torch.Tensor:
        return x.clone()

    @name_op.register_fake
    def _(x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.empty_like(x)

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None

    name_op.register_autograd(backward)
    return torch.ops.functrans.checkpoint_name.default


def checkpoint_name(x: Any, name: str) -> Any:
    """Name ``x`` (a tensor or pytree of tensors) for ``save_only_these_names`` and friends.

    >>> import torch, functrans as ft
    >>> ft.checkpoint_name(torch.ones(2), "h")
    tensor([1., 1.])
    """
    op = checkpoint_name_op()
    return optree.tree_map(
        lambda t: op(t, name) if isinstance(t, torch.Tensor) else t, x, namespace=NAMESPACE
    )
