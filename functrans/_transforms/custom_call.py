"""One call of a function with a custom derivative rule, as a ``torch.autograd.Function``.

``custom_vjp`` and ``custom_jvp`` (:mod:`functrans._transforms.custom`) run their rules as
autograd Functions, whose operands must be tensors. What both do to a call is here: keyword
arguments bound to positions by the function's signature (:func:`positional`), the argument
pytrees split into tensor operands and static leaves kept in a :class:`Call` record
(:func:`apply_rule`), the outputs rebuilt from the Function's flat result, and a rule that closes
over a tensor an enclosing transform differentiates refused (its derivative would be lost),
whether or not the call itself runs the rule.
The rules themselves, what differs between reverse and forward mode, stay in ``custom``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from functrans._core.context import functorch_active
from functrans._core.dtypes import differentiable
from functrans._core.errors import InvalidArgumentError, UnsupportedOpError
from functrans._core.pytree import NAMESPACE
from functrans._core.stack import fn_name, transform_frame
from functrans._trace.trace_run import no_saved_tensor_hooks

from .func import stop_gradient

__all__ = [
    "SLOT",
    "Call",
    "apply_rule",
    "bound_positional",
    "checked_argnums",
    "distinct_outputs",
    "fill_slots",
    "float_vjp",
    "is_tensor",
    "needs_rule",
    "positional",
    "rebuild_args",
    "refuse_differentiated_closures",
    "split_tensors",
    "stop_nondiff",
    "tree_flatten",
    "tree_unflatten",
]


@dataclass
class Call:
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


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """``tree``'s leaves (None is a leaf: an argument may be None) and spec."""
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE, none_is_leaf=True)
    return leaves, spec


def tree_unflatten(spec: Any, leaves: Any) -> Any:
    """The tree ``spec`` describes, with ``leaves``."""
    return optree.tree_unflatten(spec, list(leaves))


def is_tensor(x: Any) -> bool:
    """Whether leaf ``x`` is a tensor: an operand of the rule's Function."""
    return isinstance(x, torch.Tensor)


SLOT = object()  # where a tensor leaf goes back


def split_tensors(leaves: list[Any]) -> tuple[list[torch.Tensor], list[Any]]:
    """Tensor leaves, and every leaf with tensors replaced by a slot (to put them back)."""
    return [x for x in leaves if is_tensor(x)], [SLOT if is_tensor(x) else x for x in leaves]


def _merge(statics: list[Any], mask: list[bool], tensors: Any) -> list[Any]:
    it = iter(tensors)
    return [next(it) if m else s for s, m in zip(statics, mask, strict=True)]


def rebuild_args(call: Call, mask: list[bool], tensors: Any) -> tuple[Any, ...]:
    """The positional arguments of ``call`` with ``tensors`` (primals, or tangents) put back at
    the tensor leaves ``mask`` marks."""
    args: tuple[Any, ...] = tree_unflatten(call.in_spec, _merge(call.in_statics, mask, tensors))
    return args


def fill_slots(statics: list[Any], tensors: Any) -> list[Any]:
    """``statics`` with ``tensors`` put back at the slots :func:`split_tensors` left."""
    it = iter(tensors)
    return [next(it) if s is SLOT else s for s in statics]


def distinct_outputs(inputs: Any, outputs: Any) -> tuple[torch.Tensor, ...]:
    """``outputs`` with every tensor that is an input or an earlier output replaced by a view
    of it: autograd gives each output of a Function its own gradient slot."""
    seen = {id(t) for t in inputs}
    out = []
    for t in outputs:
        out.append(t.view_as(t) if id(t) in seen else t)
        seen.add(id(t))
    return tuple(out)


def checked_argnums(nums: Any, what: str, fun: Any) -> tuple[int, ...]:
    """``nondiff_argnums`` as a sorted tuple, or :class:`InvalidArgumentError`."""
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


def positional(
    fun: Any, what: str, args: tuple[Any, ...], kwargs: dict[str, Any], nondiff: tuple[int, ...]
) -> tuple[Any, ...]:
    """``args`` and ``kwargs`` as positional arguments only, by ``fun``'s signature with its
    defaults filled in (JAX's ``resolve_kwargs``); the ``nondiff`` ones stop gradients."""
    return stop_nondiff(bound_positional(fun, what, args, kwargs, nondiff), nondiff)


def stop_nondiff(args: tuple[Any, ...], nondiff: tuple[int, ...]) -> tuple[Any, ...]:
    """``args`` with gradients stopped at the ``nondiff`` positions."""
    if not nondiff:
        return args
    return tuple(stop_gradient(a) if i in nondiff else a for i, a in enumerate(args))


def bound_positional(
    fun: Any, what: str, args: tuple[Any, ...], kwargs: dict[str, Any], nondiff: tuple[int, ...]
) -> tuple[Any, ...]:
    """:func:`positional` before gradients are stopped: the very objects the caller passed."""
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
    return args


def needs_rule(args: Any) -> bool:
    """Whether a gradient can flow: some tensor argument requires grad, or a torch.func
    transform may differentiate (it tracks its own levels)."""
    if functorch_active():
        return True
    return torch.is_grad_enabled() and any(
        is_tensor(x) and x.requires_grad for x in optree.tree_leaves(args, namespace=NAMESPACE)
    )


def apply_rule(
    function: type[torch.autograd.Function],
    rule: Any,
    transform: str,
    args: tuple[Any, ...],
    nondiff: tuple[int, ...] = (),
) -> Any:
    """``function.apply`` on the tensor leaves of ``args`` (the rest travel as statics), and
    the rule's function's outputs rebuilt (residual outputs, after them, are left out). The
    caller has checked the rule's closures (:func:`refuse_differentiated_closures`)."""
    leaves, spec = tree_flatten(args)
    tensors, statics = split_tensors(leaves)
    call = Call(spec, statics, len(args), [is_tensor(x) for x in leaves], nondiff)
    with transform_frame(transform, rule.fun):
        flat = function.apply(rule, call, *tensors)  # type: ignore[no-untyped-call]  # torch: untyped
    return tree_unflatten(call.out_spec, fill_slots(call.out_statics, flat[: call.n_out]))


def _differentiated(t: torch.Tensor) -> bool:
    """Whether some torch.func grad/jvp level tracks ``t`` (through any vmap levels)."""
    fc = torch._C._functorch
    while fc.is_functorch_wrapped_tensor(t):
        if fc.is_gradtrackingtensor(t):
            return True
        t = fc.get_unwrapped(t)
    return t.requires_grad and torch.is_grad_enabled()  # autograd (a functrans trace) tracks it


def refuse_differentiated_closures(rule: Any, transform: str) -> None:
    """A rule's functions closing over a tensor an enclosing transform differentiates (a
    torch.func grad/jvp level, or autograd: a functrans trace, eager ``requires_grad``): its
    derivative would be lost (or torch asserts), so it is refused, as JAX refuses closed-over
    tracers in custom_jvp and custom_vjp. Checked on every call that is not inside the rule,
    whether it runs the rule or the plain function: whether the *arguments* carry a gradient
    must not decide whether the closure is refused (``ft.grad`` and ``ft.jvp`` agree)."""
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
            if is_tensor(value) and _differentiated(value):
                raise UnsupportedOpError(
                    f"{transform} {fn_name(rule.fun)}: {fn_name(fn)} closes over tensor "
                    f"{name!r}, which an enclosing transform differentiates; a custom rule "
                    f"cannot see its tangent, so its derivative would be lost. Pass {name} "
                    "as an argument of the function (and give it a gradient/tangent in the "
                    "rule)"
                )


def float_vjp(
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

    with no_saved_tensor_hooks():  # torch.func refuses to start under any (eager remat's)
        found: Any = torch.func.vjp(over_floats, *[inputs[i] for i in where])
    outs, vjp_fn = found[0], found[1]

    def full_vjp(cots: Any) -> list[Any]:
        grads: list[Any] = [None] * len(inputs)
        for i, g in zip(where, vjp_fn(cots), strict=True):
            grads[i] = g
        return grads

    return outs, full_vjp
