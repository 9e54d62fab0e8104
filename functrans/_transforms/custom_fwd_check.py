"""``custom_vjp``: ``fwd``'s primal output must have the type of the function's own.

As JAX checks, the first element ``fwd`` returns must have the function's pytree structure and
each tensor's shape, dtype and device: otherwise the result would depend on whether autograd
tracks the arguments (the function's output when it does not, ``fwd``'s when it does).
:func:`check_primal_out` compares it with what the function returned where ``fwd`` called it on
its own arguments, else with what :func:`~functrans.eval_shape` finds, remembered per input
type; a mismatch is an :class:`~functrans.InvalidArgumentError` naming the first leaf that
differs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from functrans._core.errors import InvalidArgumentError, TraceError
from functrans._core.stack import fn_name
from functrans._core.validate import describe

from .custom_call import Call, is_tensor, rebuild_args, tree_flatten
from .func import ShapeDtypeStruct, eval_shape

__all__ = ["check_primal_out"]


#: static output leaves compared by value (others by type only: no value of theirs is a type)
_VALUE_STATICS = (
    type(None),
    bool,
    int,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
)

#: input types a custom_vjp remembers its function's output type for (see _check_primal_out)
_CHECKED_MAX = 64


def _static_key(x: Any) -> tuple[Any, ...]:
    return (type(x), x) if isinstance(x, _VALUE_STATICS) else (type(x),)


def _meta(x: Any) -> tuple[Any, torch.dtype, torch.device] | None:
    """A tensor's (or an eval_shape result's) shape, dtype and device; None for other leaves."""
    if is_tensor(x) or isinstance(x, ShapeDtypeStruct):
        return tuple(x.shape), x.dtype, x.device
    return None


def check_primal_out(
    rule: Any, call: Call, tensors: Any, out: tuple[list[Any], Any], seen: list[Any]
) -> None:
    """Refuse ``fwd``'s primal output (``out``: its leaves and spec) unless it has the type of
    the function's own on these arguments (JAX compares fwd's output avals to the primal's).
    The function's type is ``seen`` where fwd called it on them (no run more), else
    :func:`eval_shape`'s, remembered per input type: a remembered type only ever confirms a
    match, a mismatch is always found afresh, so state the input types do not cover (closures,
    autocast) can skip a check, never refuse a right ``fwd``."""
    if seen:
        _refuse_mismatch(rule, out, seen[0])
        return
    try:  # a symbolic size does not hash: then nothing is remembered
        found = (out[1], tuple(_type_key(x) for x in out[0]))
        key = (
            call.in_spec,
            tuple((t.shape, t.dtype, t.device) for t in tensors),
            tuple(_type_key(x, by_id=True) for x in call.in_statics),
        )
        hit = rule._checked.get(key) == found
    except TypeError:
        key = None
        hit = False
    if hit:
        return
    expected = _abstract_out(rule, call, tensors)
    if expected is not None:
        _refuse_mismatch(rule, out, expected)
    if key is not None:  # checked, or not checkable (no run more per call for nothing)
        if len(rule._checked) >= _CHECKED_MAX:
            rule._checked.clear()
        rule._checked[key] = found


def _type_key(x: Any, by_id: bool = False) -> tuple[Any, ...]:
    """A leaf's type, hashable: a tensor's shape, dtype and device; a static leaf's value
    (with ``by_id``, an argument's: numbers by value, other objects by id, so that a key keeps
    nothing alive)."""
    if is_tensor(x):
        return x.shape, x.dtype, x.device
    if by_id:
        return (
            (type(x), x) if isinstance(x, (*_VALUE_STATICS, float, complex)) else (type(x), id(x))
        )
    return _static_key(x)


def _abstract_out(rule: Any, call: Call, tensors: Any) -> Any:
    """The function's output on these arguments, its tensors as :class:`ShapeDtypeStruct` s
    (:func:`eval_shape`: nothing runs on real data, nothing is traced); None where the function
    cannot run on fake tensors (it reads a tensor's value): then nothing is checked."""
    finished: list[bool] = []

    @functools.wraps(rule.fun)
    def primal(*args: Any) -> Any:
        out = rule.fun(*args)
        finished.append(True)
        return out

    try:
        return eval_shape(primal, *rebuild_args(call, call.mask, tensors))
    except Exception as e:
        if not finished:  # it reads a value, or an op has no fake kernel: nothing to compare
            return None
        # it ran: eval_shape refused what it left behind (a fake tensor it stored)
        name = fn_name(rule.fun)
        raise TraceError(
            f"custom_vjp {name}: fwd {fn_name(rule.fwd)} does not call {name} on its "
            f"arguments, so {name}'s output type (which fwd's primal output must have) was "
            f"found by running {name} on fake tensors, as JAX traces it, and that run failed: "
            f"{e}\nHave fwd call {name} itself, fwd(*args) -> ({name}(*args), residuals): then "
            f"{name} runs as written and nothing more runs"
        ) from e


def _refuse_mismatch(rule: Any, out: tuple[list[Any], Any], expected: Any) -> None:
    """:class:`InvalidArgumentError` naming the first leaf where ``fwd``'s primal output
    (``out``: its leaves and spec) and the function's ``expected`` one differ in structure,
    shape, dtype or device."""
    found = _first_difference(out, tree_flatten(expected))
    if found is None:
        return
    path, got, want = found
    name = fn_name(rule.fun)
    what = (
        f"has structure {got}, where {name} returns {want}"
        if path is None
        else f"differs from {name}'s at output{path}: {got} where {name} returns {want}"
    )
    raise InvalidArgumentError(
        f"custom_vjp {name}: fwd {fn_name(rule.fwd)}'s primal output {what}; fwd must return "
        f"({name}(*args), residuals): its first element is what {name} returns, as in JAX"
    )


def _first_difference(
    out: tuple[list[Any], Any], expected: tuple[list[Any], Any]
) -> tuple[str | None, str, str] | None:
    """``(path, got, want)`` where two flattened trees first differ (path None: in structure)."""
    (out_leaves, out_spec), (expected_leaves, expected_spec) = out, expected
    if out_spec != expected_spec:
        return None, str(out_spec), str(expected_spec)
    for i, (got, want) in enumerate(zip(out_leaves, expected_leaves, strict=True)):
        found = _difference(got, want)
        if found is not None:
            return expected_spec.accessors()[i].codify(""), found[0], found[1]
    return None


def _difference(got: Any, want: Any) -> tuple[str, str] | None:
    """How leaf ``got`` differs from ``want`` (their descriptions), or None if it does not."""
    got_meta, want_meta = _meta(got), _meta(want)
    if got_meta is None or want_meta is None:
        if got_meta is None and want_meta is None and _static_key(got) == _static_key(want):
            return None
        return _describe_type(got), _describe_type(want)
    (got_shape, got_dtype, got_device), (shape, dtype, device) = got_meta, want_meta
    if len(got_shape) != len(shape) or any(
        _dims_differ(a, b) for a, b in zip(got_shape, shape, strict=True)
    ):
        return f"shape {_shape(got_shape)}", f"shape {_shape(shape)}"
    if got_dtype != dtype:
        return f"dtype {got_dtype}", f"dtype {dtype}"
    if got_device != device:
        return f"device {got_device}", f"device {device}"
    return None


def _describe_type(x: Any) -> str:
    meta = _meta(x)
    if meta is None:
        return describe(x)
    return f"a {meta[1]} tensor of shape {_shape(meta[0])}"


def _shape(shape: tuple[Any, ...]) -> str:
    return f"({', '.join(str(d) for d in shape)}{',' if len(shape) == 1 else ''})"


def _dims_differ(a: Any, b: Any) -> bool:
    """Whether two sizes surely differ (symbolic ones: without adding a guard)."""
    if type(a) is int and type(b) is int:
        return a != b
    return statically_known_true(a != b)
