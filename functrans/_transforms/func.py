"""Forward mode, batching and Jacobians: ``jvp``, ``linearize``, ``vmap``, ``jacrev``,
``jacfwd``, ``hessian``, plus ``stop_gradient`` and ``eval_shape``.

They take torch.func's signatures and build on torch.func, so their results are ordinary
functions of tensors: ``ft.trace``/``ft.joint``/``ft.jit`` of them record ATen graphs (functorch
lowers batching and forward mode to ATen ops as it runs), which strategies partition and
backends compile, and they nest with functrans' own transforms in any order.

One composition is planned, not just run: ``vmap(grad(f))`` called eagerly (per-example
gradients) is the gradient of ``sum_i f(p_i, x_i)`` with respect to per-example copies
``p_i`` of the shared arguments, one joint graph that ``grad``'s ``partition`` strategy cuts,
so the per-example gradient step saves what the strategy chose.

>>> import torch, functrans as ft
>>> loss = lambda w, x: (x @ w).tanh().sum()
>>> w, xs = torch.ones(3, 2), torch.ones(5, 3)
>>> per_example = ft.vmap(ft.grad(loss, partition="min_cut"), in_dims=(None, 0))(w, xs)
>>> per_example.shape
torch.Size([5, 3, 2])
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, cast

import optree
import torch

from functrans._core.context import functorch_active, runs_as_written
from functrans._core.errors import InvalidArgumentError
from functrans._core.marks import leave
from functrans._core.pytree import NAMESPACE
from functrans._core.stack import transform_frame
from functrans._core.torch_func_errors import torch_func_arguments, user_calls
from functrans._core.validate import (
    check_argnums,
    check_bool,
    check_callable,
    check_dims,
    check_primals,
    check_tangents,
    describe,
)
from functrans._trace.escape import refuse_batched_escapes, refuse_escapes
from functrans._trace.trace_run import no_saved_tensor_hooks

from .grad import _value_and_grad_fn
from .transform_records import GradSpec, Rewrap, VmapOfGrad, grad_name, plan_of, plan_per_example

__all__ = [
    "ShapeDtypeStruct",
    "eval_shape",
    "hessian",
    "jacfwd",
    "jacrev",
    "jvp",
    "linearize",
    "stop_gradient",
    "vmap",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")

_RANDOMNESS = ("error", "different", "same")


def _frame(
    name: str,
    f: Callable[..., Any],
    call: Callable[..., _R],
    hint: Callable[[], str] = str,
    reverse: bool = False,
) -> Callable[..., _R]:
    """``call`` run inside transform frame ``name`` of ``f``, with ``f``'s name and docs; what
    torch.func raises about the arguments is an :class:`InvalidArgumentError` naming ``name``
    (and ``hint()``), what ``f`` raises is left as it is. ``reverse``: ``call`` is torch.func's
    reverse mode, which refuses to start under saved-tensor hooks; the caller's (an eager
    ``remat`` region's, ``save_on_cpu``) are set aside while it runs, as a trace does, and its
    values are saved as without them."""

    @functools.wraps(f, updated=())
    def run(*args: Any, **kwargs: Any) -> _R:
        with transform_frame(name, f), torch_func_arguments(name, hint):
            if not reverse:
                return call(*args, **kwargs)
            with no_saved_tensor_hooks():
                return call(*args, **kwargs)

    return run


def vmap(
    func: Callable[_P, _R],
    in_dims: Any = 0,
    out_dims: Any = 0,
    randomness: str = "error",
    *,
    chunk_size: int | None = None,
) -> Callable[_P, _R]:
    """Vectorize ``func`` over a batch dimension of its inputs (``torch.func.vmap``'s signature
    and semantics: ``in_dims``/``out_dims`` are ints, None or pytree prefixes of the arguments and
    outputs; ``randomness`` is ``"error"``, ``"different"`` or ``"same"``).

    >>> import torch, functrans as ft
    >>> ft.vmap(torch.dot)(torch.ones(4, 3), torch.ones(4, 3))
    tensor([3., 3., 3., 3.])
    """
    check_callable("vmap", "func", func)
    check_dims("vmap", "in_dims", in_dims)
    check_dims("vmap", "out_dims", out_dims)
    _check_randomness("vmap", randomness)
    _check_chunk_size("vmap", chunk_size)
    batched = torch.func.vmap(
        user_calls(func), in_dims, out_dims, randomness, chunk_size=chunk_size
    )
    spec = plan_of(func, GradSpec)  # None for a wrapper (jit, remat) that copied the record

    compiled = _batched_jit(func, in_dims, out_dims, randomness, chunk_size)

    def call(*args: Any, **kwargs: Any) -> Any:
        if spec is not None and out_dims == 0 and chunk_size is None:
            planned = _per_example(spec, in_dims, randomness, args, kwargs)
            if planned is not _NOT_PLANNED:
                return planned
        if compiled is not None and not runs_as_written():
            return compiled(*args, **kwargs)
        out = batched(*args, **kwargs)
        refuse_batched_escapes(func)  # a batched tensor f stored fails on first use
        return out

    def hint() -> str:
        return f" (vmap's in_dims={in_dims!r}, out_dims={out_dims!r})"

    wrapped = _frame("vmap", func, call, hint)
    if spec is not None and out_dims == 0 and chunk_size is None:
        leave(wrapped, VmapOfGrad(wrapped, spec, in_dims, randomness))
    return wrapped


def _check_randomness(where: str, randomness: object) -> None:
    if not isinstance(randomness, str) or randomness not in _RANDOMNESS:
        raise InvalidArgumentError(
            f"{where}: randomness={randomness!r}; accepted: {', '.join(map(repr, _RANDOMNESS))}"
        )


def _check_chunk_size(where: str, chunk_size: object) -> None:
    if chunk_size is not None and (
        not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
    ):
        raise InvalidArgumentError(
            f"{where}: chunk_size={chunk_size!r}; accepted: None or an int >= 1"
        )


_NOT_PLANNED = object()


def _batched_jit(
    func: Callable[..., Any], in_dims: Any, out_dims: Any, randomness: str, chunk_size: Any
) -> Callable[..., Any] | None:
    """For ``vmap(jit(f))``: the batched ``f``, jitted with ``jit``'s options (one compiled
    graph of the batched function, as ``jax.vmap(jax.jit(f))`` gives); else None."""
    if not isinstance(func, Rewrap):
        return None
    inner = torch.func.vmap(func.fn, in_dims, out_dims, randomness, chunk_size=chunk_size)
    functools.update_wrapper(inner, func.fn)
    return func.rewrap(inner)


def _per_example(
    spec: GradSpec, in_dims: Any, randomness: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``vmap(grad(f), in_dims)(*args)`` as one joint graph cut by the grad's strategy (see
    :func:`plan_per_example`); ``_NOT_PLANNED`` inside traces and other transforms, where the
    enclosing graph decides, and where the plan does not apply."""
    if runs_as_written():
        return _NOT_PLANNED
    plan = plan_per_example(spec, spec.f, in_dims, randomness, args)
    if plan is None:
        return _NOT_PLANNED
    name = grad_name(spec)
    (_, values), grads = _value_and_grad_fn(
        plan.total, spec.argnums, True, spec.partition, dict(spec.options), name
    )(*plan.args, **kwargs)
    return plan.finish(values, grads)


def jvp(
    func: Callable[..., Any],
    primals: Any,
    tangents: Any,
    *,
    strict: bool = False,
    has_aux: bool = False,
) -> Any:
    """Forward mode: ``(func(*primals), J @ tangents)`` (``torch.func.jvp``'s signature; with
    ``has_aux``, ``(output, jvp_out, aux)``). ``jvp(grad(f), (x,), (v,))`` is a Hessian-vector
    product.

    >>> import torch, functrans as ft
    >>> ft.jvp(torch.sin, (torch.zeros(2),), (torch.ones(2),))
    (tensor([0., 0.]), tensor([1., 1.]))
    """
    check_callable("jvp", "func", func)
    check_bool("jvp", "strict", strict)
    check_bool("jvp", "has_aux", has_aux)
    primals, tangents = _as_tuple(primals, "primals"), _as_tuple(tangents, "tangents")
    check_primals("jvp", primals)
    check_tangents("jvp", tangents, primals)
    return _frame("jvp", func, torch.func.jvp)(
        user_calls(func), primals, tangents, strict=strict, has_aux=has_aux
    )


def _as_tuple(x: Any, what: str) -> tuple[Any, ...]:
    if isinstance(x, tuple):
        return x
    if isinstance(x, list):
        return tuple(x)
    raise InvalidArgumentError(
        f"jvp: {what} must be a tuple with one entry per argument of the function (e.g. "
        f"({what[:-1]},)); got {what}={describe(x)}"
    )


def linearize(func: Callable[..., Any], *primals: Any) -> tuple[Any, Callable[..., Any]]:
    """``(func(*primals), jvp_fn)``: ``jvp_fn(*tangents)`` is the Jacobian-vector product at
    ``primals``, with the forward evaluated once (``torch.func.linearize``). Under other
    transforms or inside a trace, ``jvp_fn`` runs forward mode each call instead.

    >>> import torch, functrans as ft
    >>> out, jvp_fn = ft.linearize(torch.sin, torch.zeros(3))
    >>> jvp_fn(torch.ones(3))
    tensor([1., 1., 1.])
    """
    check_callable("linearize", "func", func)
    check_primals("linearize", primals)

    def checked(jvp_fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*tangents: Any) -> Any:
            check_tangents("linearize: jvp_fn", tangents, primals)
            return jvp_fn(*tangents)

        return run

    def call(*ps: Any) -> tuple[Any, Callable[..., Any]]:
        if not runs_as_written():
            import warnings

            with warnings.catch_warnings():  # torch's constant folding warns about get_attr
                warnings.simplefilter("ignore", UserWarning)
                found = torch.func.linearize(user_calls(func), *ps)
            return found[0], checked(found[1])
        out = func(*ps)

        def jvp_fn(*tangents: Any) -> Any:
            return torch.func.jvp(func, ps, tangents)[1]

        return out, checked(jvp_fn)

    return _frame("linearize", func, call)(*primals)


def jacrev(
    func: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    *,
    has_aux: bool = False,
    chunk_size: int | None = None,
) -> Callable[..., Any]:
    """The Jacobian of ``func`` by reverse mode (``torch.func.jacrev``), pytrees in and out.

    >>> import torch, functrans as ft
    >>> ft.jacrev(lambda x: x**2)(torch.tensor([1.0, 2.0]))
    tensor([[2., 0.],
            [0., 4.]])
    """
    _check_jacobian("jacrev", func, argnums, has_aux)
    _check_chunk_size("jacrev", chunk_size)
    jac = torch.func.jacrev(user_calls(func), argnums, has_aux=has_aux, chunk_size=chunk_size)
    return _frame("jacrev", func, jac, lambda: f" (jacrev's argnums={argnums!r})", reverse=True)


def _check_jacobian(where: str, func: Any, argnums: Any, has_aux: Any) -> None:
    check_callable(where, "func", func)
    check_argnums(where, argnums)
    check_bool(where, "has_aux", has_aux)


def jacfwd(
    func: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    *,
    randomness: str = "error",
) -> Callable[..., Any]:
    """The Jacobian of ``func`` by forward mode (``torch.func.jacfwd``).

    >>> import torch, functrans as ft
    >>> ft.jacfwd(torch.sin)(torch.zeros(2))
    tensor([[1., 0.],
            [0., 1.]])
    """
    _check_jacobian("jacfwd", func, argnums, has_aux)
    _check_randomness("jacfwd", randomness)
    jac = torch.func.jacfwd(user_calls(func), argnums, has_aux, randomness=randomness)
    return _frame("jacfwd", func, jac, lambda: f" (jacfwd's argnums={argnums!r})")


def hessian(func: Callable[..., Any], argnums: int | tuple[int, ...] = 0) -> Callable[..., Any]:
    """The Hessian of scalar ``func``: ``jacfwd(jacrev(func))`` (``torch.func.hessian``).

    >>> import torch, functrans as ft
    >>> ft.hessian(lambda x: (x**3).sum())(torch.tensor([1.0, 2.0]))
    tensor([[ 6.,  0.],
            [ 0., 12.]])
    """
    _check_jacobian("hessian", func, argnums, False)
    hess = torch.func.hessian(user_calls(func), argnums)
    return _frame("hessian", func, hess, lambda: f" (hessian's argnums={argnums!r})", reverse=True)


def stop_gradient(x: _T) -> _T:
    """``x`` (any pytree) with every tensor detached: no gradient flows through it, at any
    nesting level (``jax.lax.stop_gradient``).

    >>> import torch, functrans as ft
    >>> ft.grad(lambda x: (x * ft.stop_gradient(x)).sum())(torch.tensor([3.0]))
    tensor([3.])
    """
    tree: Any = x
    stopped: Any = optree.tree_map(
        lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree, namespace=NAMESPACE
    )
    return cast(_T, stopped)


_CPU = torch.device("cpu")


def _struct_of(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ShapeDtypeStruct(tuple(x.shape), x.dtype, x.device)
    return x


@dataclass(frozen=True)
class ShapeDtypeStruct:
    """The shape, dtype and device of a tensor, without its data: what :func:`eval_shape`
    returns for each output tensor, and accepted in place of an input tensor.

    >>> ShapeDtypeStruct((2, 3), torch.float32).ndim
    2
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device = _CPU

    def __post_init__(self) -> None:
        shape: Any = self.shape
        if not isinstance(shape, (tuple, list, torch.Size)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise InvalidArgumentError(
                f"ShapeDtypeStruct: shape={describe(shape)} is not accepted; shape must be a "
                "tuple of ints >= 0"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidArgumentError(
                f"ShapeDtypeStruct: dtype={describe(self.dtype)} is not accepted; dtype must be "
                "a torch.dtype (e.g. torch.float32)"
            )

    @property
    def ndim(self) -> int:
        return len(self.shape)


def eval_shape(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The shapes and dtypes of ``func(*args, **kwargs)``'s outputs, computed without running
    it: every tensor output becomes a :class:`ShapeDtypeStruct`. Arguments may be tensors or
    :class:`ShapeDtypeStruct` s.

    >>> import torch, functrans as ft
    >>> ft.eval_shape(lambda x: {"y": x @ x.T}, ft.ShapeDtypeStruct((1000, 30), torch.float16))
    {'y': ShapeDtypeStruct(shape=(1000, 1000), dtype=torch.float16, device=device(type='cpu'))}
    """
    check_callable("eval_shape", "func", func)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    from functrans._trace.capture import reach, swapped
    from functrans._trace.trace_run import run_traced

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    given: Any = (args, kwargs)
    # shapes read here, where torch.func's transforms show the per-example (logical) ones
    specs = optree.tree_map(_struct_of, given, namespace=NAMESPACE)
    # what the function captures (closures, globals, module state) is faked too: an in-place
    # update inside (BatchNorm's counters) must not touch the real tensors
    found = reach(func)
    paths = [p for ps in found.tensors.values() for p in ps if p.writable]

    def fake(x: Any) -> Any:
        if isinstance(x, ShapeDtypeStruct):
            with mode:
                return torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return x

    originals = [p.read(func) for p in paths]
    captured: list[torch.Tensor] = []

    def run() -> Any:
        # inside a trace or torch.func transform: shapes only, nothing recorded or transformed
        with _disable_current_modes():
            a, kw = optree.tree_map(fake, specs, namespace=NAMESPACE)
            captured[:] = [mode.from_tensor(t) for t in originals]
            with swapped(paths, func, captured), mode:
                return func(*a, **kw)

    # outside torch.func transforms, none to hide: the function may start its own (a jvp of a
    # custom_jvp needs functorch's dispatch, which _DisableFuncTorch would switch off)
    hide = torch._C._DisableFuncTorch() if functorch_active() else contextlib.nullcontext()
    with hide:
        out = run_traced(run, func)
    # a captured tensor stored as it came in is handed over; anything else fake is refused
    stand_ins = list(zip(captured, originals, strict=True))
    refuse_escapes(func, mode, "eval_shape", stand_ins=stand_ins)
    return optree.tree_map(
        lambda t: (
            ShapeDtypeStruct(tuple(t.shape), t.dtype, t.device)
            if isinstance(t, torch.Tensor)
            else t
        ),
        out,
        namespace=NAMESPACE,
    )
