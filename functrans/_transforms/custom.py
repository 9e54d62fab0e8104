"""Custom differentiation rules: ``custom_vjp`` and ``custom_jvp`` (JAX's API on pytrees).

Both are ``torch.autograd.Function`` s underneath (in the form torch.func transforms accept,
with a generated vmap rule), so they run eagerly, under ``torch.func`` and ``ft.vmap``/``jvp``,
and inside every functrans trace, where their rules are recorded as ATen ops.

In a joint graph, a ``custom_vjp``'s residuals (what ``fwd`` returns for ``bwd``) are exactly
what is saved for it: their nodes carry the rule's ``residual_policy`` (``MUST_SAVE`` unless the
rule says otherwise), so no strategy recomputes them behind the rule's back.

>>> import torch, functrans as ft
>>> @ft.custom_vjp
... def clip_gradient(x):
...     return x
>>> def fwd(x):
...     return x, None
>>> def bwd(res, g):
...     return (g.clamp(-1.0, 1.0),)
>>> clip_gradient.defvjp(fwd, bwd)
>>> ft.grad(lambda x: (clip_gradient(x) * 10).sum())(torch.ones(2))
tensor([1., 1.])
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, ParamSpec, TypeVar, cast

import optree
import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

from functrans._core.context import functorch_active
from functrans._core.dtypes import differentiable, differentiable_dtype
from functrans._core.errors import FunctransError, InvalidArgumentError, UnsupportedOpError
from functrans._core.pytree import NAMESPACE
from functrans._core.stack import fn_name, transform_frame
from functrans._core.tags import REMAT, Policy
from functrans._core.validate import check_callable
from functrans._trace.trace import _no_saved_tensor_hooks

__all__ = ["custom_jvp", "custom_vjp"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _flatten(tree: Any) -> tuple[list[Any], Any]:
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE, none_is_leaf=True)
    return leaves, spec


def _unflatten(spec: Any, leaves: Any) -> Any:
    return optree.tree_unflatten(spec, list(leaves))


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


@dataclass
class _Call:
    """One call's static structure, filled as forward runs (non-tensor leaves stay here)."""

    in_spec: Any
    in_statics: list[Any]
    n_args: int
    #: per leaf of the arguments: whether it is a tensor (an operand of the Function). Kept
    #: here, not passed as an operand: torch.func pytree-flattens operands, and a list of
    #: bools there misaligns the generated vmap rule's tangent dims (jvp(vmap(f)))
    mask: list[bool] = field(default_factory=list)
    nondiff: tuple[int, ...] = ()  # nondiff_argnums: passed to bwd / the jvp rule first
    out_spec: Any = None
    out_statics: list[Any] = field(default_factory=list)
    res_spec: Any = None
    res_statics: list[Any] = field(default_factory=list)
    #: a residual leaf that may hide tensors (a function, e.g. an ``ft.vjp`` function, or an
    #: object): their gradients can only be found by running ``fwd`` again (see backward)
    res_opaque: bool = False
    n_out: int = 0
    out_meta: list[tuple[torch.Size, torch.dtype, torch.device]] = field(default_factory=list)


_SLOT = object()  # where a tensor leaf goes back


def _distinct(inputs: Any, outputs: Any) -> tuple[torch.Tensor, ...]:
    """``outputs`` with every tensor that is an input or an earlier output replaced by a view
    of it: autograd gives each output of a Function its own gradient slot."""
    seen = {id(t) for t in inputs}
    out = []
    for t in outputs:
        out.append(t.view_as(t) if id(t) in seen else t)
        seen.add(id(t))
    return tuple(out)


def _split(leaves: list[Any]) -> tuple[list[torch.Tensor], list[Any]]:
    """Tensor leaves, and every leaf with tensors replaced by a slot (to put them back)."""
    return [x for x in leaves if _is_tensor(x)], [_SLOT if _is_tensor(x) else x for x in leaves]


def _merge(statics: list[Any], mask: list[bool], tensors: Any) -> list[Any]:
    it = iter(tensors)
    return [next(it) if m else s for s, m in zip(statics, mask, strict=True)]


def _args(call: _Call, mask: list[bool], tensors: Any) -> tuple[Any, ...]:
    args: tuple[Any, ...] = _unflatten(call.in_spec, _merge(call.in_statics, mask, tensors))
    return args


def _tag_residuals(residuals: list[torch.Tensor], policy: Policy) -> None:
    """Inside a trace: the nodes holding ``residuals`` carry ``policy`` (first tag wins)."""
    mode = get_proxy_mode()
    if mode is None:
        return
    for t in residuals:
        slot = get_proxy_slot(t, mode.tracer, None)
        if slot is not None:
            slot.proxy.node.meta.setdefault(REMAT, policy)


class _VjpRule(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(rule: custom_vjp[..., Any], call: _Call, *tensors: Any) -> Any:
        out, res = _run_fwd(rule, call, tensors)  # fwd may call the function: plainly
        out_leaves, call.out_spec = _flatten(out)
        res_leaves, call.res_spec = _flatten(res)
        out_t, call.out_statics = _split(out_leaves)
        res_t, call.res_statics = _split(res_leaves)
        call.res_opaque = any(not _plain_static(x) for x in call.res_statics)
        call.n_out = len(out_t)
        _tag_residuals(res_t, rule.residual_policy)
        # residuals leave as outputs (the form torch.func accepts); they stay differentiable,
        # so a gradient of bwd's result (double backward) flows back through fwd
        call.out_meta = [(t.shape, t.dtype, t.device) for t in out_t]
        return _distinct(tensors, (*out_t, *res_t))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        call: _Call = inputs[1]
        ctx.rule, ctx.call, ctx.mask = inputs[0], call, call.mask
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs[2:], *output[call.n_out :])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        call: _Call = ctx.call
        saved = ctx.saved_tensors
        inputs, residuals = (
            saved[: len(saved) - len(grads) + call.n_out],
            saved[len(saved) - len(grads) + call.n_out :],
        )
        res = _unflatten(call.res_spec, _fill(call.res_statics, residuals))
        outs_g = [  # bwd gets a tensor for every output, zeros where nothing flowed
            g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device) in zip(grads[: call.n_out], call.out_meta, strict=True)
        ]
        ct = _unflatten(call.out_spec, _fill(call.out_statics, outs_g))
        if call.res_opaque and torch.is_grad_enabled():
            # create_graph (double backward): a residual hides tensors from autograd (fwd
            # returned an ft.vjp function, JAX's nestable vjp), so fwd runs again here, where
            # autograd records it, and the result is differentiable through the residuals
            res = _run_fwd(ctx.rule, call, inputs)[1]
            return (
                None,
                None,
                *_input_grads(ctx.rule, call, ctx.mask, _bwd(ctx.rule, call, inputs, res, ct)),
            )
        found = _input_grads(ctx.rule, call, ctx.mask, _bwd(ctx.rule, call, inputs, res, ct))
        res_g = grads[call.n_out :]
        if any(g is not None for g in res_g):  # higher order: through fwd's residuals
            found = _add(found, _residual_grads(ctx.rule, call, ctx.mask, inputs, res_g))
        return (None, None, *found)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        name = fn_name(ctx.rule.fun)
        raise UnsupportedOpError(
            f"custom_vjp {name} has a reverse-mode rule only, so forward mode (jvp, jacfwd, "
            "hessian) cannot differentiate it, as in JAX; use ft.custom_jvp (reverse mode "
            "transposes it) or differentiate it with grad/vjp/jacrev"
        )


def _float_vjp(
    fn: Callable[..., tuple[torch.Tensor, ...]], inputs: Sequence[torch.Tensor]
) -> tuple[tuple[torch.Tensor, ...], Callable[[Any], list[Any]]]:
    """``torch.func.vjp`` of ``fn`` over its floating-point inputs only (integer and boolean
    ones held fixed, their gradient None): differentiating them is not defined."""
    where = [i for i, t in enumerate(inputs) if differentiable(t)]

    def over_floats(*floats: torch.Tensor) -> tuple[torch.Tensor, ...]:
        full = list(inputs)
        for i, t in zip(where, floats, strict=True):
            full[i] = t
        return fn(*full)

    with _no_saved_tensor_hooks():  # torch.func refuses to start under any (eager remat's)
        found: Any = torch.func.vjp(over_floats, *[inputs[i] for i in where])
    outs, vjp_fn = found[0], found[1]

    def full_vjp(cots: Any) -> list[Any]:
        grads: list[Any] = [None] * len(inputs)
        for i, g in zip(where, vjp_fn(cots), strict=True):
            grads[i] = g
        return grads

    return outs, full_vjp


def _residual_grads(
    rule: Any, call: _Call, mask: list[bool], inputs: Any, res_g: Any
) -> tuple[Any, ...]:
    """The inputs' gradients from cotangents of the residuals: the vjp of ``fwd``."""

    def residuals_of(*tensors: Any) -> tuple[torch.Tensor, ...]:
        _, res = _run_fwd(rule, call, tensors)
        return tuple(x for x in _flatten(res)[0] if _is_tensor(x))

    res, vjp_fn = _float_vjp(residuals_of, inputs)
    cots = tuple(
        g if g is not None else torch.zeros_like(r) for g, r in zip(res_g, res, strict=True)
    )
    return tuple(vjp_fn(cots))


def _run_fwd(rule: Any, call: _Call, tensors: Any) -> tuple[Any, Any]:
    """``fwd`` on the arguments rebuilt from ``tensors`` (the function called inside is plain)."""
    token = _IN_RULE.set(_IN_RULE.get() | {id(rule)})
    try:
        found = rule.fwd(*_args(call, call.mask, tensors))
    finally:
        _IN_RULE.reset(token)
    if not (isinstance(found, tuple | list) and len(found) == 2):
        raise InvalidArgumentError(
            f"custom_vjp {fn_name(rule.fun)}: fwd must return a pair (output, residuals); it "
            f"returned {type(found).__name__}"
        )
    return found[0], found[1]


def _bwd(rule: Any, call: _Call, inputs: Any, res: Any, ct: Any) -> Any:
    """``bwd(*nondiff_args, res, ct)``, and its result as one entry per argument (None at the
    ``nondiff_argnums`` positions, which bwd gives no gradient for, as in JAX)."""
    if not call.nondiff:
        return rule.bwd(res, ct)
    args = _args(call, call.mask, inputs)
    found = rule.bwd(*[args[i] for i in call.nondiff], res, ct)
    n_diff = call.n_args - len(call.nondiff)
    if not isinstance(found, tuple | list) or len(found) != n_diff:
        raise InvalidArgumentError(
            f"custom_vjp {fn_name(rule.fun)}: bwd must return a tuple with one gradient per "
            f"differentiable argument ({n_diff}: nondiff_argnums={call.nondiff} get none); it "
            f"returned {type(found).__name__}"
            + (f" of length {len(found)}" if isinstance(found, tuple | list) else "")
        )
    it = iter(found)
    return tuple(None if i in call.nondiff else next(it) for i in range(call.n_args))


_PLAIN_STATICS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
)


def _plain_static(x: Any) -> bool:
    """Whether a non-tensor residual leaf is a plain value (nothing autograd could track)."""
    return x is _SLOT or isinstance(x, _PLAIN_STATICS)


def _add(a: Any, b: Any) -> list[Any]:
    return [x if y is None else y if x is None else x + y for x, y in zip(a, b, strict=True)]


def _fill(statics: list[Any], tensors: Any) -> list[Any]:
    it = iter(tensors)
    return [next(it) if s is _SLOT else s for s in statics]


def _input_grads(rule: Any, call: _Call, mask: list[bool], found: Any) -> list[Any]:
    """``bwd``'s per-argument result as gradients of the flat tensor inputs."""
    name = fn_name(rule.fun)
    if not isinstance(found, tuple | list) or len(found) != call.n_args:
        raise InvalidArgumentError(
            f"custom_vjp {name}: bwd must return a tuple with one gradient per positional "
            f"argument ({call.n_args}); it returned {type(found).__name__}"
            + (f" of length {len(found)}" if isinstance(found, tuple | list) else "")
        )
    leaves, spec = _flatten(tuple(found))
    if spec != call.in_spec:
        # None for a whole argument: no gradient for any of its leaves
        filled: list[Any] = []
        for arg, g in zip(_unflatten(call.in_spec, call.in_statics), found, strict=True):
            arg_leaves, arg_spec = _flatten(arg)
            if g is None:
                filled.extend([None] * len(arg_leaves))
                continue
            g_leaves, g_spec = _flatten(g)
            if g_spec != arg_spec:
                raise InvalidArgumentError(
                    f"custom_vjp {name}: bwd returned a gradient of structure {g_spec} for an "
                    f"argument of structure {arg_spec}"
                )
            filled.extend(g_leaves)
        leaves = filled
    return [g for g, m in zip(leaves, mask, strict=True) if m]


class custom_vjp(Generic[_P, _R]):  # JAX's name
    """A function with a custom reverse-mode rule: ``f.defvjp(fwd, bwd)``.

    ``fwd(*args)`` returns ``(output, residuals)`` (any pytrees); ``bwd(residuals, cotangent)``
    returns one gradient per positional argument (a pytree like the argument, or None).
    ``residual_policy`` is what a partition does with the residuals (``Policy.MUST_SAVE``,
    the default: always saved; ``Policy.MUST_RECOMPUTE`` to recompute them in backward).

    As in JAX, ``nondiff_argnums`` names arguments that are not differentiated (functions,
    configuration; tensors there get no gradient): ``fwd`` still takes every argument, ``bwd``
    takes them first, ``bwd(*nondiff_args, residuals, cotangent)``, and returns gradients for
    the other arguments only. Keyword arguments are bound to positions by ``fun``'s signature
    (defaults filled in), so the rules always see positional arguments.

    >>> import torch, functrans as ft
    >>> @ft.custom_vjp
    ... def f(x, y):
    ...     return torch.sin(x) * y
    >>> f.defvjp(lambda x, y: (f(x, y), (torch.cos(x), torch.sin(x), y)),
    ...          lambda res, g: (res[0] * res[2] * g, res[1] * g))
    >>> ft.grad(lambda x, y: f(x, y).sum(), argnums=(0, 1))(torch.zeros(2), torch.ones(2))
    (tensor([1., 1.]), tensor([0., 0.]))
    >>> def app(fn, x):
    ...     return fn(x)
    >>> app = ft.custom_vjp(app, nondiff_argnums=(0,))
    >>> app.defvjp(lambda fn, x: (fn(x), x), lambda fn, x, g: (g * 10,))
    >>> ft.grad(lambda x: app(torch.sin, x=x).sum())(torch.zeros(2))
    tensor([10., 10.])
    """

    def __init__(
        self,
        fun: Callable[_P, _R],
        nondiff_argnums: int | Sequence[int] = (),
        *,
        residual_policy: Policy = Policy.MUST_SAVE,
    ) -> None:
        if not isinstance(residual_policy, Policy):
            raise InvalidArgumentError(
                f"custom_vjp: residual_policy={residual_policy!r}; accepted: a "
                f"functrans.extend.Policy ({', '.join(p.name for p in Policy)})"
            )
        check_callable("custom_vjp", "fun", fun)
        self.fun = fun
        self.nondiff_argnums = _argnums(nondiff_argnums, "custom_vjp", fun)
        self.residual_policy = residual_policy
        self.fwd: Callable[..., Any] | None = None
        self.bwd: Callable[..., Any] | None = None
        functools.update_wrapper(self, fun)

    def defvjp(self, fwd: Callable[..., Any], bwd: Callable[..., Any]) -> None:
        """Set the rule: ``fwd(*args) -> (output, residuals)``, ``bwd(residuals, g) -> grads``
        (``bwd(*nondiff_args, residuals, g)`` with ``nondiff_argnums``)."""
        self.fwd, self.bwd = fwd, bwd

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        full = _positional(self.fun, "custom_vjp", args, kwargs, self.nondiff_argnums)
        if not _needs_rule(full) or id(self) in _IN_RULE.get():
            return cast(Callable[..., _R], self.fun)(*full)
        if self.fwd is None:
            raise FunctransError(
                f"custom_vjp {fn_name(self.fun)}: differentiated before its rule was set; call "
                f"{fn_name(self.fun)}.defvjp(fwd, bwd) first"
            )
        result: _R = _apply_rule(_VjpRule, self, "custom_vjp", full, self.nondiff_argnums)
        return result


def _argnums(nums: Any, what: str, fun: Any) -> tuple[int, ...]:
    found = (nums,) if isinstance(nums, int) else nums
    if not (
        isinstance(found, tuple | list)
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in found)
        and len(set(found)) == len(found)
    ):
        raise InvalidArgumentError(
            f"{what} {fn_name(fun)}: nondiff_argnums={nums!r}; accepted: an int or a sequence "
            "of distinct non-negative ints (positions of the function's arguments)"
        )
    return tuple(sorted(found))


def _positional(
    fun: Any, what: str, args: tuple[Any, ...], kwargs: dict[str, Any], nondiff: tuple[int, ...]
) -> tuple[Any, ...]:
    """``args`` and ``kwargs`` as positional arguments only, by ``fun``'s signature with its
    defaults filled in (JAX's ``resolve_kwargs``); the ``nondiff`` ones stop gradients."""
    name = fn_name(fun)
    try:
        bound = inspect.signature(fun).bind(*args, **kwargs)
    except TypeError as e:
        raise InvalidArgumentError(f"{what} {name}: {e}") from None
    except ValueError:  # no signature (a builtin): positional arguments only
        if kwargs:
            raise InvalidArgumentError(
                f"{what} {name}: has no Python signature to bind keyword arguments "
                f"{sorted(kwargs)} to positions; pass them positionally"
            ) from None
        bound = None
    if bound is not None:
        bound.apply_defaults()
        if bound.kwargs:
            raise InvalidArgumentError(
                f"{what} {name}: keyword arguments {sorted(bound.kwargs)} could not be bound to "
                "positions (keyword-only parameters or **kwargs); the rules take positional "
                "arguments only: make them positional parameters of the function"
            )
        args = tuple(bound.args)
    bad = [i for i in nondiff if i >= len(args)]
    if bad:
        raise InvalidArgumentError(
            f"{what} {name}: nondiff_argnums={nondiff} names argument {bad[0]}, but it was "
            f"called with {len(args)} arguments"
        )
    if not nondiff:
        return args
    from .func import stop_gradient

    return tuple(stop_gradient(a) if i in nondiff else a for i, a in enumerate(args))


#: ids of the custom_vjp whose fwd is running: a call to the function there is plain
_IN_RULE: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "functrans_in_custom_rule", default=frozenset()
)


def _needs_rule(args: Any) -> bool:
    """Whether a gradient can flow: some tensor argument requires grad, or a torch.func
    transform may differentiate (it tracks its own levels)."""
    if functorch_active():
        return True
    return torch.is_grad_enabled() and any(
        _is_tensor(x) and x.requires_grad for x in optree.tree_leaves(args, namespace=NAMESPACE)
    )


class _JvpRule(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(rule: custom_jvp[..., Any], call: _Call, *tensors: Any) -> Any:
        out = rule.fun(*_args(call, call.mask, tensors))
        out_leaves, call.out_spec = _flatten(out)
        out_t, call.out_statics = _split(out_leaves)
        call.n_out = len(out_t)
        call.out_meta = [(t.shape, t.dtype, t.device) for t in out_t]
        return _distinct(tensors, out_t)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.rule, ctx.call, ctx.mask = inputs[0], inputs[1], inputs[1].mask
        ctx.save_for_backward(*inputs[2:])
        ctx.save_for_forward(*inputs[2:])
        outs = output if isinstance(output, tuple) else (output,)
        ctx.mark_non_differentiable(*[o for o in outs if not differentiable(o)])

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        primals = ctx.saved_tensors  # tangents: one per input, the 2 static ones first
        ts = [
            t if t is not None else torch.zeros_like(p)
            for t, p in zip(tangents[2:], primals, strict=True)
        ]
        found = _tangent_out(ctx.rule, ctx.call, ctx.mask, primals, ts)
        return tuple(  # zeros where the rule gave None for a float output
            t
            if t is not None or not differentiable_dtype(dtype)
            else torch.zeros(shape, dtype=dtype)
            for t, (shape, dtype, _) in zip(found, ctx.call.out_meta, strict=True)
        )

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        # the rule is linear in the tangents: its transpose at the primals is the vjp
        primals = ctx.saved_tensors
        floats = [
            i for i, (_, dtype, _) in enumerate(ctx.call.out_meta) if differentiable_dtype(dtype)
        ]

        def tangent_out(*ts: Any) -> tuple[torch.Tensor, ...]:
            found = _tangent_out(ctx.rule, ctx.call, ctx.mask, primals, ts)
            meta = ctx.call.out_meta
            return tuple(
                t if (t := found[i]) is not None else torch.zeros(meta[i][0], dtype=meta[i][1])
                for i in floats
            )

        outs, vjp_fn = _float_vjp(tangent_out, [torch.zeros_like(p) for p in primals])
        cots = tuple(
            grads[i] if grads[i] is not None else torch.zeros_like(o)
            for i, o in zip(floats, outs, strict=True)
        )
        return (None, None, *vjp_fn(cots))


def _tangent_out(
    rule: custom_jvp[..., Any], call: _Call, mask: list[bool], primals: Any, tangents: Any
) -> list[torch.Tensor | None]:
    """The rule's tangent for every tensor output (None where it gave none)."""
    args = _args(call, mask, primals)
    t_args = _args(call, mask, tangents)
    name = fn_name(rule.fun)
    assert rule.jvp is not None
    if call.nondiff:
        diff = [i for i in range(call.n_args) if i not in call.nondiff]
        found = rule.jvp(
            *[args[i] for i in call.nondiff],
            tuple(args[i] for i in diff),
            tuple(t_args[i] for i in diff),
        )
    else:
        found = rule.jvp(args, t_args)
    if not (isinstance(found, tuple | list) and len(found) == 2):
        raise InvalidArgumentError(
            f"custom_jvp {name}: the jvp rule must return (primal_out, tangent_out); it "
            f"returned {type(found).__name__}"
        )
    t_leaves, t_spec = _flatten(found[1])
    if t_spec != call.out_spec:
        raise InvalidArgumentError(
            f"custom_jvp {name}: tangent_out has structure {t_spec}, the output {call.out_spec}"
        )
    out_leaves = _flatten(_unflatten(call.out_spec, call.out_statics))[0]
    return [
        t if _is_tensor(t) else None
        for t, o in zip(t_leaves, out_leaves, strict=True)
        if o is _SLOT
    ]


class custom_jvp(Generic[_P, _R]):  # JAX's name
    """A function with a custom forward-mode rule: ``f.defjvp(rule)`` with
    ``rule(primals, tangents) -> (primal_out, tangent_out)`` (tuples of the positional
    arguments). Reverse mode transposes the rule (it must be linear in the tangents), so
    ``grad`` works too. With ``nondiff_argnums`` (JAX's API) those arguments are passed to
    the rule first and left out of ``primals`` and ``tangents``: ``rule(*nondiff_args,
    primals, tangents)``; they get no tangent and no gradient. Keyword arguments are bound to
    positions by ``fun``'s signature, as for :class:`custom_vjp`.

    >>> import torch, functrans as ft
    >>> @ft.custom_jvp
    ... def log1pexp(x):
    ...     return torch.log1p(torch.exp(x))
    >>> @log1pexp.defjvp
    ... def _(primals, tangents):
    ...     (x,), (t,) = primals, tangents
    ...     return log1pexp(x), t * torch.sigmoid(x)
    >>> ft.grad(lambda x: log1pexp(x).sum())(torch.tensor([100.0]))  # exp(100) would overflow
    tensor([1.])
    """

    def __init__(self, fun: Callable[_P, _R], nondiff_argnums: int | Sequence[int] = ()) -> None:
        check_callable("custom_jvp", "fun", fun)
        self.fun = fun
        self.nondiff_argnums = _argnums(nondiff_argnums, "custom_jvp", fun)
        self.jvp: Callable[..., Any] | None = None
        functools.update_wrapper(self, fun)

    def defjvp(self, jvp: Callable[..., Any]) -> Callable[..., Any]:
        """Set the rule ``jvp(primals, tangents) -> (primal_out, tangent_out)``; returns it
        (so it can be used as a decorator)."""
        self.jvp = jvp
        return jvp

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        full = _positional(self.fun, "custom_jvp", args, kwargs, self.nondiff_argnums)
        if self.jvp is None:
            raise FunctransError(f"custom_jvp {fn_name(self.fun)}: no rule; call defjvp first")
        if not _needs_rule(full) and not _forward_ad_active(full):
            return cast(Callable[..., _R], self.fun)(*full)
        result: _R = _apply_rule(_JvpRule, self, "custom_jvp", full, self.nondiff_argnums)
        return result


def _apply_rule(
    function: type[torch.autograd.Function],
    rule: Any,
    transform: str,
    args: tuple[Any, ...],
    nondiff: tuple[int, ...] = (),
) -> Any:
    """``function.apply`` on the tensor leaves of ``args`` (the rest travel as statics), and
    the rule's function's outputs rebuilt (residual outputs, after them, are left out)."""
    _refuse_differentiated_closures(rule, transform)
    leaves, spec = _flatten(args)
    tensors, statics = _split(leaves)
    call = _Call(spec, statics, len(args), [_is_tensor(x) for x in leaves], nondiff)
    with transform_frame(transform, rule.fun):
        flat = function.apply(rule, call, *tensors)  # type: ignore[no-untyped-call]
    return _unflatten(call.out_spec, _fill(call.out_statics, flat[: call.n_out]))


def _differentiated(t: torch.Tensor) -> bool:
    """Whether some torch.func grad/jvp level tracks ``t`` (through any vmap levels)."""
    fc = torch._C._functorch
    while fc.is_functorch_wrapped_tensor(t):
        if fc.is_gradtrackingtensor(t):
            return True
        t = fc.get_unwrapped(t)
    return t.requires_grad and torch.is_grad_enabled()  # autograd (a functrans trace) tracks it


def _refuse_differentiated_closures(rule: Any, transform: str) -> None:
    """A rule's functions closing over a tensor a torch.func grad/jvp differentiates: its
    derivative would be lost (or torch asserts), so it is refused, as JAX refuses
    closed-over tracers in custom_vjp."""
    fns = [rule.fun, getattr(rule, "jvp", None), getattr(rule, "fwd", None)]
    fns.append(getattr(rule, "bwd", None))
    for fn in fns:
        for name, cell in zip(
            getattr(getattr(fn, "__code__", None), "co_freevars", ()),
            getattr(fn, "__closure__", None) or (),
            strict=False,
        ):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if _is_tensor(value) and _differentiated(value):
                raise UnsupportedOpError(
                    f"{transform} {fn_name(rule.fun)}: {fn_name(fn)} closes over tensor "
                    f"{name!r}, which an enclosing transform differentiates; a custom rule "
                    f"cannot see its tangent, so its derivative would be lost. Pass {name} "
                    "as an argument of the function (and give it a gradient/tangent in the "
                    "rule)"
                )


def _forward_ad_active(args: Any) -> bool:
    import torch.autograd.forward_ad as fwAD

    return any(
        _is_tensor(x) and fwAD.unpack_dual(x).tangent is not None  # type: ignore[no-untyped-call]
        for x in optree.tree_leaves(args, namespace=NAMESPACE)
    )
