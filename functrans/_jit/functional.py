"""``grad`` and ``value_and_grad`` that trace once per input signature, as ``jit`` does.

:func:`functrans._transforms.grad.grad` traces ``f``'s joint graph and partitions it on every
call: 33 ms a call for a 4-layer MLP where ``torch.func.grad`` takes 1.7 ms. The public
``grad`` and ``value_and_grad`` are that function run through a
:class:`~.jitted.Jitted` of it: the first call with a signature traces and partitions with the
``partition=`` strategy and options given (``jit(grad(f, partition=...))``'s plan, so a
``peak_bytes`` budget holds for every call), later calls run the compiled graph, guarded on
everything the trace read. Where the inputs require grad, the gradients are differentiable in
them (the entry is the joint graph of the gradient: its double backward), as they were. Inside
another functrans trace and under ``torch.func`` transforms the call runs as written, as
before (the outer transform sees its ops). A call the jit cannot compile (a module path a
trace cannot follow, as a BatchNorm with ``momentum=None`` in training; hooks; a tensor
subclass it cannot take apart) runs torch's autograd eagerly
(:func:`functrans._transforms.grad.eager_grad`): eager's gradient, eager's buffer updates.
Errors name ``grad``, not the jit it runs through.

>>> import torch, functrans as ft
>>> g = ft.grad(lambda x: (x * x).sum())
>>> g(torch.tensor([1.0, 2.0])), g(torch.tensor([3.0, 4.0]))
(tensor([2., 4.]), tensor([6., 8.]))
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, ParamSpec, TypeVar, overload

import optree
import torch

from functrans._core.context import runs_as_written
from functrans._core.dtypes import differentiable
from functrans._core.errors import InvalidArgumentError
from functrans._core.marks import leave
from functrans._core.pytree import NAMESPACE
from functrans._core.stack import transform_frame
from functrans._core.validate import check_callable, check_cotangents
from functrans._cut.partition import Strategy, check_partition_options
from functrans._transforms import grad as _grad
from functrans._transforms.inline import pull_back
from functrans._transforms.transform_records import GradSpec, plan_of

from .jitted import Jitted
from .options import Options

__all__ = ["grad", "value_and_grad", "vjp"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def grad(
    f: Callable[_P, Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    partition: str | Strategy = "default",
    **options: Any,
) -> Callable[_P, Any]:
    """The gradient of scalar-valued ``f`` with respect to the arguments ``argnums``; it takes
    ``f``'s parameters. The first call with an input signature traces; later ones reuse the
    compiled graph (see the module docstring).

    - ``f``: a function of pytrees of tensors returning a scalar tensor (with ``has_aux``, a
      pair ``(scalar, aux)``);
    - ``argnums``: the position of the argument differentiated, or a tuple of positions (the
      gradients then come back as a tuple, in that order); each gradient has its argument's
      pytree structure, zeros where the output does not depend on a leaf (as
      ``torch.func.grad`` and JAX give);
    - ``has_aux``: ``f`` returns ``(scalar, aux)``; the call returns ``(grads, aux)``, ``aux``
      as ``f`` returned it (not differentiated);
    - ``partition``: the strategy that chooses what the gradient saves between its forward
      and backward (a registered name, ``"default"``, ``"min_cut"``, ``"full_remat"``,
      ``"memory_budget"``, ``"min_peak"``, or a strategy callable);
    - ``**options``: that strategy's options (``budget=``, ``max_bytes=``, ``peak_bytes=``
      for ``"memory_budget"``: ``peak_bytes`` bounds the call's measured peak); a name the
      strategy does not take is an :class:`~functrans.InvalidArgumentError` here, when the
      gradient is made.

    >>> import torch, functrans as ft
    >>> ft.grad(lambda x, y: (x * y).sum(), argnums=(0, 1))(torch.ones(2), torch.full((2,), 3.0))
    (tensor([3., 3.]), tensor([1., 1.]))
    >>> grads, aux = ft.grad(lambda x: ((x * x).sum(), x.max()), has_aux=True)(torch.ones(2))
    >>> grads, aux
    (tensor([2., 2.]), tensor(1.))
    """
    run = _grad.grad(f, argnums, has_aux, partition=partition, **options)
    eager = _grad.eager_grad(f, argnums, has_aux, with_value=False)
    return _reusing(run, "grad", f, eager)


def value_and_grad(
    f: Callable[_P, _R],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    partition: str | Strategy = "default",
    **options: Any,
) -> Callable[_P, tuple[_R, Any]]:
    """Like :func:`grad` but returns ``(value, grads)`` (``((value, aux), grads)`` with aux):
    it takes ``f``'s parameters and ``value`` is what ``f`` returns. ``argnums``, ``has_aux``,
    ``partition`` and ``**options`` are :func:`grad`'s.

    >>> import torch, functrans as ft
    >>> ft.value_and_grad(lambda x: (x * x).sum())(torch.tensor([1.0, 2.0]))
    (tensor(5.), tensor([2., 4.]))
    """
    run = _grad.value_and_grad(f, argnums, has_aux, partition=partition, **options)
    eager = _grad.eager_grad(f, argnums, has_aux, with_value=True)
    return _reusing(run, "value_and_grad", f, eager)


def _reusing(
    run: Callable[_P, _R], transform: str, f: Any, eager: Callable[_P, _R]
) -> Callable[_P, _R]:
    """``run`` (``transform`` of ``f``) through a jit of it, on calls that can be compiled;
    ``eager`` (torch's autograd, run as written) on those that cannot (a module's path a
    trace cannot follow, hooks, a tensor subclass it cannot take apart)."""
    owner = f"{transform}({getattr(f, '__qualname__', type(f).__name__)})"
    options = Options("default", "aten", (), "auto", {})
    jitted = Jitted(run, options, shown=False, owner=owner, as_written=eager)

    @functools.wraps(run)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if runs_as_written():
            return run(*args, **kwargs)
        try:
            with transform_frame(transform, f):  # what the jit's own trace refuses names it
                return jitted(*args, **kwargs)
        except InvalidArgumentError:  # bad input: grad's own check names the parameter
            run(*args, **kwargs)
            raise

    spec = plan_of(run, GradSpec)
    assert spec is not None  # grad marks the function it returns
    leave(call, dataclasses.replace(spec, run=call))  # jit(grad(f)) and vmap plan it so
    return call


@overload
def vjp(
    f: Callable[..., _R],
    *primals: Any,
    partition: str | Strategy = "default",
    has_aux: Literal[False] = False,
    **options: Any,
) -> tuple[_R, Callable[[Any], tuple[Any, ...]]]: ...


@overload
def vjp(
    f: Callable[..., Any],
    *primals: Any,
    partition: str | Strategy = "default",
    has_aux: Literal[True],
    **options: Any,
) -> tuple[Any, Callable[[Any], tuple[Any, ...]], Any]: ...


def vjp(
    f: Callable[..., Any],
    *primals: Any,
    partition: str | Strategy = "default",
    has_aux: bool = False,
    **options: Any,
) -> Any:
    """Run ``f`` forward and return ``(outputs, vjp_fn)`` (``(outputs, vjp_fn, aux)`` with
    ``has_aux``); ``vjp_fn(cotangents)`` gives one gradient pytree per primal (None for leaves
    that are not floating-point or complex tensors). Only what ``partition`` chose is kept
    between the two calls. Repeated calls of one ``f`` with the same input signature reuse
    its compiled step: ``f`` runs through a jit of it (``partition=`` and its options are the
    jit's) and ``vjp_fn`` through the compiled backward.

    >>> import torch, functrans as ft
    >>> out, vjp_fn = ft.vjp(torch.sin, torch.zeros(2), partition="full_remat")
    >>> vjp_fn(torch.ones(2))
    (tensor([1., 1.]),)
    """
    check_callable("vjp", "f", f)
    check_partition_options("vjp", partition, options)
    jitted = None if runs_as_written() else _jit_of(f, partition, options)
    if jitted is None:  # under torch.func, in another trace, or f keeps no cache
        if has_aux:
            return _grad.vjp(f, *primals, partition=partition, has_aux=True, **options)
        return _grad.vjp(f, *primals, partition=partition, **options)
    given: Any = primals
    prims = optree.tree_map(_leaf_to_differentiate, given, namespace=NAMESPACE)
    try:
        with torch.enable_grad(), transform_frame("vjp", f):
            result = jitted(*prims)
    except InvalidArgumentError:  # bad input: vjp's own check names the primal
        _grad.vjp(f, *primals, partition=partition, **options)  # raises for a bad primal
        raise
    out, aux = _split_aux(f, result, has_aux)
    taken = optree.tree_leaves(prims, namespace=NAMESPACE)
    wrt = [t for t in taken if isinstance(t, torch.Tensor) and t.requires_grad]
    diff_out = [o for o in optree.tree_leaves(out, namespace=NAMESPACE) if differentiable(o)]
    shown = optree.tree_map(_detached, out, namespace=NAMESPACE)

    def vjp_fn(cotangents: Any) -> tuple[Any, ...]:
        tangents = check_cotangents("vjp_fn", cotangents, shown)
        grads = iter(pull_back(diff_out, wrt, tangents, create_graph=False))
        return tuple(
            optree.tree_map(
                lambda t: next(grads) if isinstance(t, torch.Tensor) and t.requires_grad else None,
                p,
                namespace=NAMESPACE,
            )
            for p in prims
        )

    if has_aux:
        return shown, vjp_fn, optree.tree_map(_detached, aux, namespace=NAMESPACE)
    return shown, vjp_fn


#: the jit each function's vjp runs through, by (strategy, options): held as long as ``f`` is
_VJP_JITS: weakref.WeakKeyDictionary[Any, dict[Any, Jitted[..., Any]]] = weakref.WeakKeyDictionary()


def _jit_of(f: Any, partition: Any, options: dict[str, Any]) -> Jitted[..., Any] | None:
    """The jit ``f``'s ``vjp`` runs through with this strategy (None: ``f`` cannot key a
    cache: a builtin, or options that do not hash)."""
    try:
        key = (partition, tuple(sorted(options.items())))
        hash(key)
        per_f = _VJP_JITS.setdefault(f, {})
    except TypeError:
        return None
    found = per_f.get(key)
    if found is None:
        owner = f"vjp({getattr(f, '__qualname__', type(f).__name__)})"
        options_ = Options(partition, "aten", (), "auto", dict(options))
        found = per_f[key] = Jitted(f, options_, shown=False, owner=owner)
    return found


def _leaf_to_differentiate(x: Any) -> Any:
    """A floating-point or complex tensor primal, as a fresh leaf that requires grad."""
    if isinstance(x, torch.Tensor) and differentiable(x):
        return x.detach().requires_grad_()
    return x


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _split_aux(f: Any, result: Any, has_aux: bool) -> tuple[Any, Any]:
    if not has_aux:
        return result, None
    if not (isinstance(result, tuple) and len(result) == 2):
        from functrans._core.validate import describe

        raise InvalidArgumentError(
            f"vjp: {getattr(f, '__qualname__', f)} was called with has_aux=True, so it must "
            f"return a pair (output, aux); it returned {describe(result)}"
        )
    return result[0], result[1]
