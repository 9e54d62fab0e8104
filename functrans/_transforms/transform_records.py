"""The plans one transform leaves for another: records, not code, so neither imports the other.

``grad`` leaves a :class:`GradSpec` record on the function it returns; ``vmap`` of such a
function leaves a :class:`VmapOfGrad`; ``jit`` of either traces the plan (one joint graph of the
per-example gradients, :func:`plan_per_example`) instead of the nested transforms. The records
travel under :mod:`functrans._core.marks`' one attribute, and :func:`plan_of` answers only a
record that describes the function it is read from (``functools.wraps`` copies records onto a
wrapper, which computes something else). ``vmap``
recognises a compiled function by the :class:`Rewrap` protocol (``jit`` implements it), the way
JAX's batching rule table never imports ``pjit``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import optree
import torch

from functrans._core.dtypes import differentiable
from functrans._core.errors import NonScalarOutputError
from functrans._core.marks import read
from functrans._core.pytree import NAMESPACE

__all__ = [
    "GradSpec",
    "PerExample",
    "Rewrap",
    "VmapOfGrad",
    "grad_name",
    "plan_of",
    "plan_per_example",
]


@runtime_checkable
class Rewrap(Protocol):
    """A compiled function that can compile another function with its own options
    (``vmap(jit(f))`` compiles the batched ``f`` this way, as ``jax.vmap(jax.jit(f))`` does).

    >>> import functrans as ft
    >>> isinstance(ft.jit(lambda x: x), Rewrap), isinstance(lambda x: x, Rewrap)
    (True, False)
    """

    @property
    def fn(self) -> Callable[..., Any]:
        """The function this compiles."""
        ...

    def rewrap(self, g: Callable[..., Any]) -> Callable[..., Any]:
        """``g`` compiled with this function's options."""
        ...


@dataclass(frozen=True)
class GradSpec:
    """What a ``grad``/``value_and_grad`` function differentiates, and how (``vmap`` of one
    plans per-example gradients as one joint graph): the record ``grad`` leaves on the function
    it returns."""

    run: Callable[..., Any]  # the function grad returned (wrappers copying attributes differ)
    f: Callable[..., Any]
    argnums: int | tuple[int, ...]
    has_aux: bool
    with_value: bool
    partition: Any
    options: tuple[tuple[str, Any], ...]


def grad_name(spec: GradSpec) -> str:
    """The transform's name in messages: ``grad`` or ``value_and_grad``."""
    return "value_and_grad" if spec.with_value else "grad"


@dataclass(frozen=True)
class VmapOfGrad:
    """What a ``vmap(grad(f))`` function batches, so ``jit`` of it can plan the per-example
    joint graph as the eager call does (see :func:`plan_per_example`): the record ``vmap``
    leaves on the function it returns."""

    run: Callable[..., Any]  # the function vmap returned
    spec: GradSpec
    in_dims: Any
    randomness: str


_Plan = TypeVar("_Plan", GradSpec, VmapOfGrad)


def plan_of(f: object, kind: type[_Plan]) -> _Plan | None:
    """The ``kind`` record that describes ``f`` itself, or None: a record a wrapper copied from
    the function it wraps (``functools.wraps`` copies ``__dict__``) describes that function,
    not the wrapper.

    >>> import functools, torch, functrans as ft
    >>> g = ft.grad(lambda x: x.sum())
    >>> plan_of(g, GradSpec).run is g
    True
    >>> plan_of(functools.wraps(g)(lambda x: g(x)), GradSpec) is None
    True
    """
    found = read(f, kind)
    return found if found is not None and found.run is f else None


@dataclass(frozen=True)
class PerExample:
    """``vmap(grad(f))`` planned as the gradient of ``sum_i f(...)`` (:attr:`total`) with
    respect to per-example copies of the shared differentiated arguments (:attr:`args`)."""

    spec: GradSpec
    total: Callable[..., tuple[torch.Tensor, Any]]
    args: tuple[Any, ...]

    def finish(self, values: Any, grads: Any) -> Any:
        """What ``vmap(grad(f))`` returns, from the per-example values and the gradients."""
        if self.spec.with_value:
            return values, grads
        return (grads, values[1]) if self.spec.has_aux else grads


def plan_per_example(
    spec: GradSpec,
    f: Callable[..., Any],
    in_dims: Any,
    randomness: str,
    args: tuple[Any, ...],
) -> PerExample | None:
    """The :class:`PerExample` plan of ``vmap(grad(f), in_dims)(*args)`` (``f``: the function
    ``spec`` differentiates, or a stand-in for it); None where it does not apply (batch dims
    other than 0 or None, a batch it cannot read: torch.func's own path names the problem)."""
    if not args:
        return None
    dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
    if len(dims) != len(args) or any(d not in (0, None) for d in dims):
        return None
    batched = [
        t
        for a, d in zip(args, dims, strict=True)
        if d == 0
        for t in optree.tree_leaves(a, namespace=NAMESPACE)
        if isinstance(t, torch.Tensor)
    ]
    batch = {t.shape[0] for t in batched if t.dim() > 0}
    if len(batch) != 1 or any(t.dim() == 0 for t in batched):
        return None
    (size,) = batch
    nums = (spec.argnums,) if isinstance(spec.argnums, int) else spec.argnums
    nums = tuple(i % len(args) for i in nums)
    new_args, new_dims = list(args), list(dims)
    for i in nums:
        if dims[i] is None:  # shared: per-example copies of its float tensors, batched at 0
            new_args[i] = optree.tree_map(
                lambda t: _per_example_copy(t, size), args[i], namespace=NAMESPACE
            )
            new_dims[i] = optree.tree_map(
                lambda t: 0 if differentiable(t) else None, args[i], namespace=NAMESPACE
            )
    each = torch.func.vmap(f, tuple(new_dims), 0, randomness)

    def total(*a: Any, **kw: Any) -> tuple[torch.Tensor, Any]:
        values = each(*a, **kw)
        out = values[0] if spec.has_aux else values
        if not (isinstance(out, torch.Tensor) and out.dim() > 0 and out.numel() == size):
            raise NonScalarOutputError(
                f"grad needs {getattr(spec.f, '__qualname__', spec.f)} to return a scalar "
                f"float tensor per example; under vmap it returned {_describe(out, size)}"
            )
        return out.sum(), values

    total.__qualname__ = getattr(spec.f, "__qualname__", "f")
    return PerExample(spec, total, tuple(new_args))


def _per_example_copy(t: Any, size: int) -> Any:
    """``size`` stride-0 copies of ``t`` (a view: gradients still flow to ``t``)."""
    return t.unsqueeze(0).expand(size, *t.shape) if differentiable(t) else t


def _describe(out: Any, size: int) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {list(out.shape[1:])} per example (batch {size})"
    return type(out).__name__
