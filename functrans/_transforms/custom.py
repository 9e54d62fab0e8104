"""Custom differentiation rules: ``custom_vjp`` and ``custom_jvp`` (JAX's API on pytrees).

Both are ``torch.autograd.Function`` s underneath (in the form torch.func transforms accept,
with a generated vmap rule), so they run eagerly, under ``torch.func`` and ``ft.vmap``/``jvp``,
and inside every functrans trace, where their rules are recorded as ATen ops. How a call
becomes the Function's operands and back (arguments bound to positions, tensor leaves split
from static ones, outputs rebuilt) is the same for both: :mod:`~functrans._transforms.custom_call`.
This module holds what differs, the reverse-mode rule and the forward-mode one.

``fwd``'s primal output must have the type of the function's own (pytree structure, and each
tensor's shape, dtype and device), as JAX checks: otherwise the result would depend on whether
autograd tracks the arguments (the function's output when it does not, ``fwd``'s when it does).
The function's output type is what it returned where ``fwd`` called it on its own arguments (the
usual ``fwd``, which costs nothing more), else what :func:`~functrans.eval_shape` finds, once
per input type (:mod:`~functrans._transforms.custom_fwd_check`).

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
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, TypeVar, cast

import optree
import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

from functrans._core.dtypes import differentiable, differentiable_dtype
from functrans._core.errors import (
    FunctransError,
    InvalidArgumentError,
    UnsupportedOpError,
)
from functrans._core.pytree import NAMESPACE
from functrans._core.stack import fn_name
from functrans._core.tags import REMAT, Policy
from functrans._core.validate import check_callable

from .custom_call import (
    SLOT,
    Call,
    apply_rule,
    bound_positional,
    checked_argnums,
    distinct_outputs,
    fill_slots,
    float_vjp,
    is_tensor,
    needs_rule,
    positional,
    rebuild_args,
    refuse_differentiated_closures,
    split_tensors,
    stop_nondiff,
    tree_flatten,
    tree_unflatten,
)
from .custom_fwd_check import check_primal_out

__all__ = ["custom_jvp", "custom_vjp"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


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
    def forward(rule: custom_vjp[..., Any], call: Call, *tensors: Any) -> Any:
        seen: list[Any] = []  # the function's output, where fwd calls it on its arguments
        out, res = _run_fwd(rule, call, tensors, seen)  # fwd may call the function: plainly
        out_leaves, call.out_spec = tree_flatten(out)
        check_primal_out(rule, call, tensors, (out_leaves, call.out_spec), seen)
        res_leaves, call.res_spec = tree_flatten(res)
        out_t, call.out_statics = split_tensors(out_leaves)
        res_t, call.res_statics = split_tensors(res_leaves)
        call.res_opaque = any(not _plain_static(x) for x in call.res_statics)
        call.n_out = len(out_t)
        _tag_residuals(res_t, rule.residual_policy)
        # residuals leave as outputs (the form torch.func accepts); they stay differentiable,
        # so a gradient of bwd's result (double backward) flows back through fwd
        call.out_meta = [(t.shape, t.dtype, t.device) for t in out_t]
        return distinct_outputs(tensors, (*out_t, *res_t))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        call: Call = inputs[1]
        ctx.rule, ctx.call, ctx.mask = inputs[0], call, call.mask
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs[2:], *output[call.n_out :])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        call: Call = ctx.call
        saved = ctx.saved_tensors
        inputs, residuals = (
            saved[: len(saved) - len(grads) + call.n_out],
            saved[len(saved) - len(grads) + call.n_out :],
        )
        res = tree_unflatten(call.res_spec, fill_slots(call.res_statics, residuals))
        outs_g = [  # bwd gets a tensor for every output, zeros where nothing flowed
            g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device) in zip(grads[: call.n_out], call.out_meta, strict=True)
        ]
        ct = tree_unflatten(call.out_spec, fill_slots(call.out_statics, outs_g))
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


def _residual_grads(
    rule: Any, call: Call, mask: list[bool], inputs: Any, res_g: Any
) -> tuple[Any, ...]:
    """The inputs' gradients from cotangents of the residuals: the vjp of ``fwd``."""

    def residuals_of(*tensors: Any) -> tuple[torch.Tensor, ...]:
        _, res = _run_fwd(rule, call, tensors)
        return tuple(x for x in tree_flatten(res)[0] if is_tensor(x))

    res, vjp_fn = float_vjp(residuals_of, inputs)
    cots = tuple(
        g if g is not None else torch.zeros_like(r) for g, r in zip(res_g, res, strict=True)
    )
    return tuple(vjp_fn(cots))


def _run_fwd(rule: Any, call: Call, tensors: Any, seen: list[Any] | None = None) -> tuple[Any, Any]:
    """``fwd`` on the arguments rebuilt from ``tensors`` (the function called inside is plain;
    what it returns for exactly these arguments is put in ``seen``)."""
    args = rebuild_args(call, call.mask, tensors)
    token = _IN_RULE.set({**_IN_RULE.get(), id(rule): _Fwd(args, seen)})
    try:
        found = rule.fwd(*args)
    finally:
        _IN_RULE.reset(token)
    if not (isinstance(found, tuple | list) and len(found) == 2):
        raise InvalidArgumentError(
            f"custom_vjp {fn_name(rule.fun)}: fwd must return a pair (output, residuals); it "
            f"returned {type(found).__name__}"
        )
    return found[0], found[1]


@dataclass(frozen=True)
class _Fwd:
    """A custom_vjp's ``fwd`` running on ``args``; ``seen`` (None: not asked for) gets what
    the function returns when ``fwd`` calls it on exactly those arguments."""

    args: tuple[Any, ...]
    seen: list[Any] | None

    def saw(self, args: tuple[Any, ...], out: Any) -> None:
        if self.seen is not None and not self.seen and _same_leaves(self.args, args):
            self.seen.append(out)


def _same_leaves(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the very same arguments, leaf for leaf (fwd passing its own
    on; anything else is not trusted as the call being checked)."""
    a_leaves, a_spec = tree_flatten(a)
    b_leaves, b_spec = tree_flatten(b)
    return a_spec == b_spec and all(x is y for x, y in zip(a_leaves, b_leaves, strict=True))


def _bwd(rule: Any, call: Call, inputs: Any, res: Any, ct: Any) -> Any:
    """``bwd(*nondiff_args, res, ct)``, and its result as one entry per argument (None at the
    ``nondiff_argnums`` positions, which bwd gives no gradient for, as in JAX)."""
    if not call.nondiff:
        return rule.bwd(res, ct)
    args = rebuild_args(call, call.mask, inputs)
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
    return x is SLOT or isinstance(x, _PLAIN_STATICS)


def _add(a: Any, b: Any) -> list[Any]:
    return [x if y is None else y if x is None else x + y for x, y in zip(a, b, strict=True)]


def _input_grads(rule: Any, call: Call, mask: list[bool], found: Any) -> list[Any]:
    """``bwd``'s per-argument result as gradients of the flat tensor inputs."""
    name = fn_name(rule.fun)
    if not isinstance(found, tuple | list) or len(found) != call.n_args:
        raise InvalidArgumentError(
            f"custom_vjp {name}: bwd must return a tuple with one gradient per positional "
            f"argument ({call.n_args}); it returned {type(found).__name__}"
            + (f" of length {len(found)}" if isinstance(found, tuple | list) else "")
        )
    leaves, spec = tree_flatten(tuple(found))
    if spec != call.in_spec:
        # None for a whole argument: no gradient for any of its leaves
        filled: list[Any] = []
        for arg, g in zip(tree_unflatten(call.in_spec, call.in_statics), found, strict=True):
            arg_leaves, arg_spec = tree_flatten(arg)
            if g is None:
                filled.extend([None] * len(arg_leaves))
                continue
            g_leaves, g_spec = tree_flatten(g)
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
        self.nondiff_argnums = checked_argnums(nondiff_argnums, "custom_vjp", fun)
        self.residual_policy = residual_policy
        self.fwd: Callable[..., Any] | None = None
        self.bwd: Callable[..., Any] | None = None
        #: per input type: the output type fwd was checked against (see check_primal_out)
        self._checked: dict[Any, Any] = {}
        functools.update_wrapper(self, fun)

    def defvjp(self, fwd: Callable[..., Any], bwd: Callable[..., Any]) -> None:
        """Set the rule: ``fwd(*args) -> (output, residuals)``, ``bwd(residuals, g) -> grads``
        (``bwd(*nondiff_args, residuals, g)`` with ``nondiff_argnums``). ``output`` must have
        the function's output type (structure, shapes, dtypes), or differentiating it raises
        :class:`~functrans.InvalidArgumentError`."""
        self.fwd, self.bwd = fwd, bwd
        self._checked = {}

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        bound = bound_positional(self.fun, "custom_vjp", args, kwargs, self.nondiff_argnums)
        full = stop_nondiff(bound, self.nondiff_argnums)
        fwd = _IN_RULE.get().get(id(self))
        if fwd is not None:  # inside its own fwd: the plain function, whose output fwd's must be
            out = cast(Callable[..., _R], self.fun)(*full)
            fwd.saw(bound, out)
            return out
        refuse_differentiated_closures(self, "custom_vjp")
        if not needs_rule(full):
            return cast(Callable[..., _R], self.fun)(*full)
        if self.fwd is None:
            raise FunctransError(
                f"custom_vjp {fn_name(self.fun)}: differentiated before its rule was set; call "
                f"{fn_name(self.fun)}.defvjp(fwd, bwd) first"
            )
        result: _R = apply_rule(_VjpRule, self, "custom_vjp", full, self.nondiff_argnums)
        return result


#: the custom_vjp whose fwd is running, by id: a call to the function there is plain
_IN_RULE: contextvars.ContextVar[Mapping[int, _Fwd]] = contextvars.ContextVar(
    "functrans_in_custom_rule", default=types.MappingProxyType({})
)


class _JvpRule(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(rule: custom_jvp[..., Any], call: Call, *tensors: Any) -> Any:
        out = rule.fun(*rebuild_args(call, call.mask, tensors))
        out_leaves, call.out_spec = tree_flatten(out)
        out_t, call.out_statics = split_tensors(out_leaves)
        call.n_out = len(out_t)
        call.out_meta = [(t.shape, t.dtype, t.device) for t in out_t]
        return distinct_outputs(tensors, out_t)

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

        outs, vjp_fn = float_vjp(tangent_out, [torch.zeros_like(p) for p in primals])
        cots = tuple(
            grads[i] if grads[i] is not None else torch.zeros_like(o)
            for i, o in zip(floats, outs, strict=True)
        )
        return (None, None, *vjp_fn(cots))


def _tangent_out(
    rule: custom_jvp[..., Any], call: Call, mask: list[bool], primals: Any, tangents: Any
) -> list[torch.Tensor | None]:
    """The rule's tangent for every tensor output (None where it gave none)."""
    args = rebuild_args(call, mask, primals)
    t_args = rebuild_args(call, mask, tangents)
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
    t_leaves, t_spec = tree_flatten(found[1])
    if t_spec != call.out_spec:
        raise InvalidArgumentError(
            f"custom_jvp {name}: tangent_out has structure {t_spec}, the output {call.out_spec}"
        )
    out_leaves = tree_flatten(tree_unflatten(call.out_spec, call.out_statics))[0]
    return [
        t if is_tensor(t) else None for t, o in zip(t_leaves, out_leaves, strict=True) if o is SLOT
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
        self.nondiff_argnums = checked_argnums(nondiff_argnums, "custom_jvp", fun)
        self.jvp: Callable[..., Any] | None = None
        functools.update_wrapper(self, fun)

    def defjvp(self, jvp: Callable[..., Any]) -> Callable[..., Any]:
        """Set the rule ``jvp(primals, tangents) -> (primal_out, tangent_out)``; returns it
        (so it can be used as a decorator)."""
        self.jvp = jvp
        return jvp

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        full = positional(self.fun, "custom_jvp", args, kwargs, self.nondiff_argnums)
        if self.jvp is None:
            raise FunctransError(f"custom_jvp {fn_name(self.fun)}: no rule; call defjvp first")
        refuse_differentiated_closures(self, "custom_jvp")
        if not needs_rule(full) and not _forward_ad_active(full):
            return cast(Callable[..., _R], self.fun)(*full)
        result: _R = apply_rule(_JvpRule, self, "custom_jvp", full, self.nondiff_argnums)
        return result


def _forward_ad_active(args: Any) -> bool:
    import torch.autograd.forward_ad as fwAD

    return any(
        is_tensor(x) and fwAD.unpack_dual(x).tangent is not None  # type: ignore[no-untyped-call]  # torch: untyped
        for x in optree.tree_leaves(args, namespace=NAMESPACE)
    )
