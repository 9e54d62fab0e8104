"""``checkpoint_name(x, name)``: an identity that names a value for name-based remat policies.

It is a real op (``functrans::checkpoint_name``) so that it shows up both to eager dispatch
modes and in traced graphs, where policies see it with its name.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar, cast

import optree
import torch

from functrans._core.context import functorch_active, is_tracing
from functrans._core.describe import describe
from functrans._core.pytree import NAMESPACE

__all__ = ["checkpoint_name", "checkpoint_name_op"]

_T = TypeVar("_T")


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


def checkpoint_name(x: _T, name: str) -> _T:
    """Name ``x`` (a tensor or pytree of tensors) for ``save_only_these_names`` and friends;
    the result has ``x``'s structure and type.

    >>> import torch, functrans as ft
    >>> ft.checkpoint_name(torch.ones(2), "h")
    tensor([1., 1.])
    """
    if not isinstance(name, str):
        from functrans._core.errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"checkpoint_name: name={describe(name)} is not accepted; name must be a str (what "
            "save_only_these_names and friends match)"
        )
    if functorch_active() and not is_tracing():
        # eager torch.func grad/vmap/jvp cannot run a custom op's autograd formula, and under
        # them eager remat runs its region as written (no policy is asked): the name has no
        # reader. Traced (ft.jit of ft.vmap(ft.grad(...))), the op is recorded as usual.
        return x
    op = checkpoint_name_op()
    tree: Any = x  # any pytree
    named = optree.tree_map(
        lambda t: op(t, name) if isinstance(t, torch.Tensor) else t, tree, namespace=NAMESPACE
    )
    return cast(_T, named)  # the same tree, a named tensor for each tensor
