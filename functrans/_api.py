"""Functional autodiff API built on ``joint`` + ``partition``: ``vjp``, ``grad``,
``value_and_grad`` with JAX / ``torch.func`` semantics and a choice of partition strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._errors import FunctransError
from ._joint import joint
from ._partition import Strategy, partition
from ._pytree import flatten

__all__ = ["grad", "value_and_grad", "vjp"]


def vjp(
    f: Callable[..., Any],
    *primals: Any,
    partition: str | Strategy = "default",
    **options: Any,
) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]:
    """Run ``f`` forward and return ``(outputs, vjp_fn)``; ``vjp_fn(cotangents)`` gives one
    gradient pytree per primal. Only what ``partition`` chose is kept between the two calls.

    >>> import torch, functrans as ft
    >>> out, vjp_fn = ft.vjp(torch.sin, torch.zeros(2), partition="full_remat")
    >>> vjp_fn(torch.ones(2))
    (tensor([1., 1.]),)
    """
    jg = joint(f)(*primals)
    p = _partition(jg, partition, options)
    outs, saved = p.forward(*primals)

    def vjp_fn(cotangents: Any) -> tuple[Any, ...]:
        leaves, flat = flatten(cotangents)
        if flat.spec != jg.fn_out.spec:
            raise FunctransError(
                f"vjp_fn: cotangents must have the structure of the outputs {jg.fn_out.spec}, "
                f"got {flat.spec}"
            )
        outs_flat, _ = flatten(outs)
        tangents = tuple(c for c, o in zip(leaves, outs_flat, strict=True) if o.is_floating_point())
        grads: tuple[Any, ...] = p.backward(saved, tangents)
        return grads

    return outs, vjp_fn


def _partition(jg: Any, strategy: str | Strategy, options: dict[str, Any]) -> Any:
    return partition(jg, strategy, **options)


def value_and_grad(
    f: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    partition: str | Strategy = "default",
    **options: Any,
) -> Callable[..., tuple[Any, Any]]:
    """Like :func:`grad` but returns ``(value, grads)`` (``((value, aux), grads)`` with aux).

    >>> import torch, functrans as ft
    >>> ft.value_and_grad(lambda x: (x * x).sum())(torch.tensor([1.0, 2.0]))
    (tensor(5.), tensor([2., 4.]))
    """

    def run(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        jg = joint(f, argnums=argnums, has_aux=has_aux)(*args, **kwargs)
        p = _partition(jg, partition, options)
        value, saved = p.forward(*args, **kwargs)
        out = value[0] if has_aux else value
        if not (isinstance(out, torch.Tensor) and out.numel() == 1 and out.is_floating_point()):
            what = f"a tensor of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else out
            raise NonScalarOutputError(
                f"grad needs {getattr(f, '__qualname__', f)} to return a scalar float tensor"
                f"{' (as the first element of (output, aux))' if has_aux else ''}; it returned "
                f"{what}. Use vjp for non-scalar outputs."
            )
        grads = p.backward(saved, (torch.ones_like(out),))
        return value, grads

    return run


class NonScalarOutputError(FunctransError, ValueError):
    """grad/value_and_grad on a function whose output is not a scalar."""


def grad(
    f: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    partition: str | Strategy = "default",
    **options: Any,
) -> Callable[..., Any]:
    """The gradient of scalar-valued ``f`` with respect to the arguments ``argnums``.

    >>> import torch, functrans as ft
    >>> ft.grad(lambda x, y: (x * y).sum(), argnums=(0, 1))(torch.ones(2), torch.full((2,), 3.0))
    (tensor([3., 3.]), tensor([1., 1.]))
    """
    vg = value_and_grad(f, argnums, has_aux, partition=partition, **options)

    def run(*args: Any, **kwargs: Any) -> Any:
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return run
