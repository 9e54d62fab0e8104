"""Reverse mode inside another functrans trace: ``ft.grad`` within ``ft.grad``/``ft.jit``.

An inner ``grad`` called while an outer transform traces cannot trace a graph of its own (its
arguments are the outer trace's tensors, in the outer fake mode). It differentiates in place
instead, with autograd, as eager double backward does: the outer trace records the backward ops
(so ``ft.joint(ft.grad(f))`` is the joint graph of a gradient function, and the outer
``partition`` strategy cuts all of it), and ``create_graph=True`` keeps them differentiable.

>>> import torch, functrans as ft
>>> f = lambda x: (x**3).sum()
>>> ft.grad(lambda x: ft.grad(f)(x).sum())(torch.tensor([1.0, 2.0]))  # d/dx sum(3x^2) = 6x
tensor([ 6., 12.])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from functrans._core.dtypes import differentiable
from functrans._core.errors import FunctransError
from functrans._core.pytree import NAMESPACE
from functrans._trace.joint import normalize_argnums

__all__ = ["inline_value_and_grad", "inline_vjp", "pull_back"]


def _watched(x: Any) -> Any:
    """``x`` ready to differentiate against: itself if the outer trace already tracks it (its
    gradient must flow on), else a detached copy that requires grad."""
    if not differentiable(x) or x.requires_grad:
        return x
    return x.detach().requires_grad_()


def _detached(tree: Any) -> Any:
    """``tree`` with its tensors cut off from any autograd graph (the outer trace's)."""
    return optree.tree_map(
        lambda x: x.detach() if isinstance(x, torch.Tensor) else x,
        tree,
        namespace=NAMESPACE,
        none_is_leaf=True,
    )


def pull_back(
    outs: Sequence[torch.Tensor],
    wrt: Sequence[Any],
    cots: Sequence[torch.Tensor],
    create_graph: bool = True,
) -> list[Any]:
    """The gradients of ``outs`` (against ``cots``) in each of ``wrt`` by autograd: zeros for
    a differentiable one they do not reach, None for the rest; the graph is kept for another
    pull (and differentiable in turn with ``create_graph``).

    >>> x, n = torch.ones(2, requires_grad=True), torch.arange(2)
    >>> pull_back([x * 3], [x, n], [torch.ones(2)], create_graph=False)
    [tensor([3., 3.]), None]
    """
    pairs = [(o, c) for o, c in zip(outs, cots, strict=True) if o.requires_grad]
    leaves = [t for t in wrt if differentiable(t)]
    found: Sequence[torch.Tensor | None] = [None] * len(leaves)
    if pairs and leaves:
        found = torch.autograd.grad(
            [o for o, _ in pairs],
            leaves,
            [c for _, c in pairs],
            create_graph=create_graph,
            retain_graph=True,
            allow_unused=True,
        )
    filled = iter(
        g if g is not None else torch.zeros_like(t) for g, t in zip(found, leaves, strict=True)
    )
    return [next(filled) if differentiable(t) else None for t in wrt]


def inline_value_and_grad(
    f: Callable[..., Any],
    argnums: int | Sequence[int],
    has_aux: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, Any]:
    """``value_and_grad(f, argnums, has_aux)(*args, **kwargs)`` with autograd, in place.

    Called under ``torch.no_grad()`` (inside the outer function), the inner gradient is still
    taken but the outer transform does not see through it: its results are constants to the
    outer trace, as torch.func computes them (``shift = grad(g)(x)`` under ``no_grad``, then
    ``grad(lambda x: x**3 - shift)`` is ``3x**2``)."""
    constant = not torch.is_grad_enabled()
    if constant:
        args = _detached(args)
    nums = normalize_argnums(argnums, len(args))
    with torch.enable_grad():
        watched = list(args)
        for i in nums:
            watched[i] = optree.tree_map(_watched, args[i], namespace=NAMESPACE)
        value = f(*watched, **kwargs)
        out = value[0] if has_aux else value
        per_arg = []
        for i in nums:
            leaves, spec = optree.tree_flatten(watched[i], namespace=NAMESPACE, none_is_leaf=True)
            grads = pull_back([out], leaves, [torch.ones_like(out)])
            per_arg.append(optree.tree_unflatten(spec, grads))
    grads_out = per_arg[0] if isinstance(argnums, int) else tuple(per_arg)
    if constant:
        return _detached(value), _detached(grads_out)
    return value, grads_out


def inline_vjp(
    f: Callable[..., Any], primals: tuple[Any, ...]
) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]:
    """``vjp(f, *primals)`` with autograd, in place (under ``torch.no_grad()``, out of the
    outer trace's sight, as :func:`inline_value_and_grad`)."""
    if not torch.is_grad_enabled():
        outs, inner = _vjp(f, _detached(primals))

        def hidden(cotangents: Any) -> tuple[Any, ...]:
            with torch.no_grad():
                result: tuple[Any, ...] = _detached(inner(cotangents))
                return result

        return _detached(outs), hidden
    return _vjp(f, primals)


def _vjp(
    f: Callable[..., Any], primals: tuple[Any, ...]
) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]:
    with torch.enable_grad():
        watched = [optree.tree_map(_watched, p, namespace=NAMESPACE) for p in primals]
        outs = f(*watched)
    out_leaves, out_spec = optree.tree_flatten(outs, namespace=NAMESPACE)

    def vjp_fn(cotangents: Any) -> tuple[Any, ...]:
        cots, spec = optree.tree_flatten(cotangents, namespace=NAMESPACE)
        if spec != out_spec:
            raise FunctransError(
                f"vjp_fn: cotangents must have the structure of the outputs {out_spec}, got {spec}"
            )
        pairs = [(o, c) for o, c in zip(out_leaves, cots, strict=True) if differentiable(o)]
        result = []
        with torch.enable_grad():
            for w in watched:
                leaves, wspec = optree.tree_flatten(w, namespace=NAMESPACE, none_is_leaf=True)
                grads = pull_back([o for o, _ in pairs], leaves, [c for _, c in pairs])
                result.append(optree.tree_unflatten(wspec, grads))
        return tuple(result)

    return outs, vjp_fn
