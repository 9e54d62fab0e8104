"""Functional autodiff API built on ``joint`` + ``partition``: ``vjp``, ``grad``,
``value_and_grad`` with JAX / ``torch.func`` semantics and a choice of partition strategy.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal, ParamSpec, TypeVar, overload

import optree
import torch

from functrans._core.context import functorch_active, is_tracing
from functrans._core.describe import check_numpy_leaves
from functrans._core.dtypes import differentiable
from functrans._core.errors import InvalidArgumentError, NonScalarOutputError, UnsupportedOpError
from functrans._core.marks import leave
from functrans._core.pytree import NAMESPACE, flatten, leaves_of, tensor_leaves
from functrans._core.stack import transform_frame
from functrans._core.validate import (
    check_argnums,
    check_bool,
    check_callable,
    check_cotangents,
    describe,
)
from functrans._cut.partition import Strategy, check_partition_options, partition
from functrans._trace.joint import joint, normalize_argnums
from functrans._trace.trace_run import no_saved_tensor_hooks

from .inline import inline_value_and_grad, inline_vjp
from .transform_records import GradSpec

__all__ = ["grad", "value_and_grad", "vjp"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


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
    """Run ``f`` forward and return ``(outputs, vjp_fn)``; ``vjp_fn(cotangents)`` gives one
    gradient pytree per primal. Only what ``partition`` chose is kept between the two calls.
    ``outputs`` has ``f``'s result type.

    >>> import torch, functrans as ft
    >>> out, vjp_fn = ft.vjp(torch.sin, torch.zeros(2), partition="full_remat")
    >>> vjp_fn(torch.ones(2))
    (tensor([1., 1.]),)
    """
    check_callable("vjp", "f", f)
    check_partition_options("vjp", partition, options)
    if has_aux:  # torch.func.vjp's form: f returns (output, aux); aux is not differentiated
        return _vjp_with_aux(f, primals, partition, options)
    with transform_frame("vjp", f):
        if functorch_active():
            return _torch_func_vjp(f, primals)
        if is_tracing():  # inside another functrans trace: the outer trace records the backward
            return inline_vjp(f, primals)
        jg = joint(f)(*primals)
    p = _partition(jg, partition, options)
    outs: Any
    outs, saved = p.forward(*primals)

    def vjp_fn(cotangents: Any) -> tuple[Any, ...]:
        tangents = tuple(check_cotangents("vjp_fn", cotangents, outs))
        grads: tuple[Any, ...] = p.backward(saved, tangents)
        return grads

    return outs, vjp_fn


def _vjp_with_aux(
    f: Callable[..., Any], primals: tuple[Any, ...], partition: Any, options: dict[str, Any]
) -> tuple[Any, Callable[[Any], tuple[Any, ...]], Any]:
    """``vjp(f, *primals, has_aux=True)``: ``(output, vjp_fn, aux)``, as ``torch.func.vjp``."""
    box: list[Any] = []

    def main(*args: Any) -> Any:
        found = f(*args)
        if not (isinstance(found, tuple) and len(found) == 2):
            raise InvalidArgumentError(
                f"vjp: {getattr(f, '__qualname__', f)} was called with has_aux=True, so it must "
                f"return a pair (output, aux); it returned {describe(found)}"
            )
        box.append(found[1])
        return found[0]

    main.__qualname__ = getattr(f, "__qualname__", "f")
    with transform_frame("vjp", f):
        if functorch_active():
            found: Any = torch.func.vjp(f, *primals, has_aux=True)
            return found[0], found[1], found[2]
        if is_tracing():
            out, inline_fn = inline_vjp(main, primals)
            return out, inline_fn, box[-1]
        jg = joint(f, has_aux=True)(*primals)
    p = _partition(jg, partition, options)
    (out, aux), saved = p.forward(*primals)

    def vjp_fn(cotangents: Any) -> tuple[Any, ...]:
        tangents = tuple(check_cotangents("vjp_fn", cotangents, out))
        grads: tuple[Any, ...] = p.backward(saved, tangents)
        return grads

    return out, vjp_fn, aux


def _partition(jg: Any, strategy: str | Strategy, options: dict[str, Any]) -> Any:
    return partition(jg, strategy, **options)


# Under torch.func transforms (torch.func.grad(ft.grad(f)), vmap(ft.grad(f)) for per-example
# gradients), the arguments are functorch's wrapped tensors, which a trace cannot take: the
# same derivative comes from torch.func itself, with the same calling conventions. Which
# values are saved is then torch.func's business, not the partition strategy's. torch.func
# refuses to start under saved-tensor hooks (an eager remat region around a vmap): they are set
# aside while it runs.
def _torch_func_vjp(
    f: Callable[..., _R], primals: tuple[Any, ...]
) -> tuple[_R, Callable[[Any], tuple[Any, ...]]]:
    with no_saved_tensor_hooks():
        found: Any = torch.func.vjp(f, *primals)
    return found[0], found[1]


def eager_grad(
    f: Callable[..., Any], argnums: int | Sequence[int], has_aux: bool, *, with_value: bool
) -> Callable[..., Any]:
    """``grad`` of ``f`` (``value_and_grad`` where ``with_value``) by torch's autograd, run as
    written: for a call that cannot be traced (a BatchNorm with ``momentum=None`` reads its
    batch counter as a Python number; hooks run on every call), what ``loss.backward()``
    would give, the modules' buffers updated as eager updates them. Gradients are those of
    the traced transform: zeros where the output does not depend on a leaf, differentiable
    in the inputs that require grad (grad mode on).

    >>> import torch
    >>> eager_grad(lambda x: (x * x).sum(), 0, False, with_value=True)(torch.ones(2))
    (tensor(2.), tensor([2., 2.]))
    """
    name = "value_and_grad" if with_value else "grad"

    def run(*args: Any, **kwargs: Any) -> Any:
        check_differentiable(f, args, argnums, name)
        nums = normalize_argnums(argnums, len(args))
        given = list(args)
        outer = torch.is_grad_enabled() and any(
            t.requires_grad for i in nums for t in tensor_leaves(given[i])
        )
        specs, wrt = [], []
        for i in nums:
            leaves, spec = leaves_of(given[i])
            fresh = [_differentiated_leaf(t, outer) for t in leaves]
            given[i] = optree.tree_unflatten(spec, fresh)
            specs.append((spec, len(fresh)))
            wrt.extend(fresh)
        with torch.enable_grad():
            value = f(*given, **kwargs)
            out = scalar_output(f, value, has_aux)
            tensors = [t for t in wrt if isinstance(t, torch.Tensor)]
            found = (
                torch.autograd.grad(out, tensors, create_graph=outer, allow_unused=True)
                if out.requires_grad and tensors
                else (None,) * len(tensors)
            )
        by_leaf = iter(found)
        flat = [_zero_if_none(next(by_leaf), t) if isinstance(t, torch.Tensor) else t for t in wrt]
        grads, start = [], 0
        for spec, n in specs:
            grads.append(optree.tree_unflatten(spec, flat[start : start + n]))
            start += n
        result = grads[0] if isinstance(argnums, int) else tuple(grads)
        if not outer:
            value = optree.tree_map(_detached, value, namespace=NAMESPACE)
        if with_value:
            return value, result
        return (result, value[1]) if has_aux else result

    return run


def _differentiated_leaf(t: Any, outer: bool) -> Any:
    """``t`` as a leaf the call differentiates in: on the caller's graph where the caller's
    autograd differentiates the result too, else a fresh leaf."""
    if not isinstance(t, torch.Tensor):
        return t
    if outer and t.requires_grad:
        return t.view_as(t)
    return t.detach().requires_grad_()


def _zero_if_none(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _torch_func_value_and_grad(
    f: Callable[..., Any], argnums: Any, has_aux: bool, args: Any, kwargs: Any
) -> tuple[Any, Any]:
    with no_saved_tensor_hooks():
        result = torch.func.grad_and_value(f, argnums, has_aux)(*args, **kwargs)
    return result[1], result[0]


def value_and_grad(
    f: Callable[_P, _R],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    partition: str | Strategy = "default",
    **options: Any,
) -> Callable[_P, tuple[_R, Any]]:
    """Like :func:`grad` but returns ``(value, grads)`` (``((value, aux), grads)`` with aux):
    it takes ``f``'s parameters and ``value`` is what ``f`` returns.

    >>> import torch, functrans as ft
    >>> ft.value_and_grad(lambda x: (x * x).sum())(torch.tensor([1.0, 2.0]))
    (tensor(5.), tensor([2., 4.]))
    """
    _check_grad_args("value_and_grad", f, argnums, has_aux)
    return _value_and_grad_fn(f, argnums, has_aux, partition, options, "value_and_grad")


def _check_grad_args(where: str, f: Any, argnums: Any, has_aux: Any) -> None:
    check_callable(where, "f", f)
    check_argnums(where, argnums)
    check_bool(where, "has_aux", has_aux)


def _value_and_grad_fn(
    f: Callable[_P, _R],
    argnums: int | Sequence[int],
    has_aux: bool,
    partition: str | Strategy,
    options: dict[str, Any],
    name: str,
) -> Callable[_P, tuple[_R, Any]]:
    check_partition_options(name, partition, options)

    def run(*args: _P.args, **kwargs: _P.kwargs) -> tuple[_R, Any]:
        with transform_frame(name, f):
            return _value_and_grad(args, kwargs)

    def _value_and_grad(args: Any, kwargs: Any) -> tuple[_R, Any]:
        check_differentiable(f, args, argnums, name)
        if functorch_active():
            return _torch_func_value_and_grad(f, argnums, has_aux, args, kwargs)
        if is_tracing():  # inside another functrans trace: the outer trace records the backward
            value, grads = inline_value_and_grad(f, argnums, has_aux, args, kwargs)
            scalar_output(f, value, has_aux)
            return value, grads
        jg = joint(f, argnums=argnums, has_aux=has_aux)(*args, **kwargs)
        p = _partition(jg, partition, options)
        value, saved = p.forward(*args, **kwargs)
        out = scalar_output(f, value, has_aux)
        grads = p.backward(saved, (torch.ones_like(out),))
        return value, grads

    leave(run, _spec(run, f, argnums, has_aux, True, partition, options))
    return run


def _spec(
    run: Callable[..., Any],
    f: Callable[..., Any],
    argnums: int | Sequence[int],
    has_aux: bool,
    with_value: bool,
    partition: Any,
    options: dict[str, Any],
) -> GradSpec:
    nums = argnums if isinstance(argnums, int) else tuple(argnums)
    return GradSpec(run, f, nums, has_aux, with_value, partition, tuple(options.items()))


def scalar_output(f: Callable[..., Any], value: Any, has_aux: bool) -> torch.Tensor:
    """The differentiated output of ``value``, or :class:`NonScalarOutputError`."""
    out = value[0] if has_aux else value
    if not (isinstance(out, torch.Tensor) and out.numel() == 1 and out.is_floating_point()):
        raise NonScalarOutputError(
            f"grad needs {getattr(f, '__qualname__', f)} to return a scalar float tensor"
            f"{' (as the first element of (output, aux))' if has_aux else ''}; it returned "
            f"{_describe_output(out)}"
        )
    return out


def _describe_output(out: Any) -> str:
    if not isinstance(out, torch.Tensor):
        return f"{describe(out)}. Use vjp for outputs that are not scalar tensors."
    what = f"a tensor of shape {list(out.shape)} and dtype {out.dtype}"
    if out.numel() != 1:
        return f"{what}. Use vjp for non-scalar outputs."
    if out.is_complex():  # torch.func.grad and loss.backward() refuse it too
        return (
            f"{what}: a complex loss has no single gradient. Return a real loss (.abs(), "
            ".real, torch.view_as_real(...)), or use vjp with a complex cotangent"
        )
    return f"{what}, which has no gradient: compute the output in floating point."


def check_differentiable(
    f: Callable[..., Any], args: tuple[Any, ...], argnums: Any, where: str = "grad"
) -> None:
    """Raise :class:`InvalidArgumentError` unless each argument ``argnums`` names holds tensors
    and they are all floating-point or complex (a complex one gets torch's conjugate Wirtinger
    gradient, as ``torch.func.grad`` gives). ``torch.func.grad`` and ``jax.grad`` refuse
    integer inputs too; a ``None`` gradient for one would silently leave it untrained.
    (:func:`vjp` takes them and gives ``None``; non-tensor leaves next to tensors are static
    and get ``None``.)

    >>> import torch
    >>> check_differentiable(lambda x, n: x * n, (torch.ones(2), torch.tensor(3)), 1)
    Traceback (most recent call last):
    ...
    functrans._core.errors.InvalidArgumentError: grad: argument 1 (n) is an integer tensor ...
    """
    names = _positional_names(f)
    for i in normalize_argnums(argnums, len(args)):
        name = names[i] if i < len(names) else f"args[{i}]"
        try:
            tensors, flat = flatten(args[i])
        except InvalidArgumentError:  # a numpy array: name the argument
            tree: Any = args[i]  # any pytree
            leaves = optree.tree_leaves(tree, namespace=NAMESPACE)
            what = f"argument {i} ({name})"
            check_numpy_leaves(where, leaves, what)
            raise
        except UnsupportedOpError as e:
            raise UnsupportedOpError(f"{where}: argument {i} ({name}): {e}") from e
        if not tensors:
            raise InvalidArgumentError(
                f"{where}: argument {i} ({name}) is {describe(args[i])}, which holds no tensor to "
                f"differentiate; gradients are defined for floating-point and complex tensors "
                f"only. Pass a tensor (torch.tensor(...)) or leave it out of argnums={argnums!r}"
            )
        for t, path in zip(tensors, flat.tensor_paths(), strict=True):
            if not differentiable(t):
                what = f"argument {i} ({name})" + (f", leaf {name}{path}," if path else "")
                raise InvalidArgumentError(f"{where}: {what} {_not_differentiable(t, argnums)}")


def _not_differentiable(t: torch.Tensor, argnums: Any) -> str:
    kind = "a boolean" if t.dtype == torch.bool else "an integer"
    return (
        f"is {kind} tensor ({t.dtype}); gradients are defined for floating-point and complex "
        f"tensors only. Convert it (.float()), leave it out of argnums={argnums!r}, or use "
        f"ft.vjp, which gives None for it"
    )


def _positional_names(f: Callable[..., Any]) -> list[str]:
    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def grad(
    f: Callable[_P, Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    partition: str | Strategy = "default",
    **options: Any,
) -> Callable[_P, Any]:
    """The gradient of scalar-valued ``f`` with respect to the arguments ``argnums``; it takes
    ``f``'s parameters.

    >>> import torch, functrans as ft
    >>> ft.grad(lambda x, y: (x * y).sum(), argnums=(0, 1))(torch.ones(2), torch.full((2,), 3.0))
    (tensor([3., 3.]), tensor([1., 1.]))
    """
    _check_grad_args("grad", f, argnums, has_aux)
    vg = _value_and_grad_fn(f, argnums, has_aux, partition, options, "grad")

    def run(*args: _P.args, **kwargs: _P.kwargs) -> Any:
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    leave(run, _spec(run, f, argnums, has_aux, False, partition, options))
    return run
