"""``ft.scan``: JAX's ``lax.scan`` over PyTorch tensors, its body a region compiled once.

``scan(f, init, xs)`` runs ``carry, y = f(carry, x)`` for each slice ``x`` of ``xs`` along the
leading axis and returns the last carry and the ``y`` stacked: the JAX form of a stack of
blocks (``xs`` the blocks' parameters stacked, the carry the activations). Eagerly it is that
loop. Inside ``ft.jit`` (or any functrans trace) the body is a repeated region
(:func:`functrans.region`): traced once and reused for every step, so a deep scan compiles as
fast as a shallow one, and the step's planner cuts it block by block, as it cuts a
``ModuleList`` (peak budgets included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree

from functrans._core.context import is_tracing
from functrans._core.errors import InvalidArgumentError
from functrans._core.validate import check_bool, check_callable, describe
from functrans._trace.regions.finding import region

__all__ = ["scan"]

_C = TypeVar("_C")


def scan(
    f: Callable[[_C, Any], tuple[_C, Any]],
    init: _C,
    xs: Any = None,
    length: int | None = None,
    *,
    reverse: bool = False,
) -> tuple[_C, Any]:
    """Loop ``carry, y = f(carry, x)`` over the leading axis of ``xs``; ``(carry, ys)``.

    ``xs`` is a pytree of tensors sharing their first dimension (or None, with ``length``
    steps of ``x = None``); ``ys`` stacks each step's ``y`` (a pytree of tensors, or None)
    along a new first dimension. ``reverse=True`` runs from the last slice to the first and
    stacks ``ys`` in the order of ``xs``, as JAX does. Under ``ft.jit`` the body is traced
    once and reused for every step (see the module docstring).

    >>> import torch, functrans as ft
    >>> ws = torch.randn(6, 4, 4, requires_grad=True)  # six blocks' weights, stacked
    >>> def block(h, w):
    ...     h = torch.tanh(h @ w)
    ...     return h, h.sum()
    >>> step = ft.jit(lambda ws, x: ft.scan(block, x, ws)[0].square().sum())
    >>> step(ws, torch.randn(2, 4)).backward()
    >>> ws.grad.shape, step.cache_info().regions_reused  # the first carry needs no grad: 2 traces
    (torch.Size([6, 4, 4]), 4)
    """
    check_callable("scan", "f", f)
    check_bool("scan", "reverse", reverse)
    leaves, spec = pytree.tree_flatten(xs) if xs is not None else ([], None)
    steps = _length(leaves, length)
    body = region(_body(f))
    carry, ys = init, []
    order = range(steps - 1, -1, -1) if reverse else range(steps)
    # traced, each step's slice is a tensor of its own: a view's storage offset is part of a
    # region's key, so views of one stacked tensor would each be a region of their own. The
    # copy costs no saved memory where the cut recomputes it from xs (min_cut, full_remat)
    traced = is_tracing()
    for i in order:
        part = [t[i].clone() if traced else t[i] for t in leaves]
        x = None if spec is None else pytree.tree_unflatten(part, spec)
        carry, y = _pair(body(carry, x), i)
        ys.append(y)
    if reverse:
        ys.reverse()
    return carry, _stacked(ys)


def _body(f: Callable[..., Any]) -> Callable[..., Any]:
    """A function of its own for the region marker (``f`` itself is left unmarked)."""

    def step(carry: Any, x: Any) -> Any:
        return f(carry, x)

    step.__qualname__ = getattr(f, "__qualname__", "scan body")
    return step


def _length(leaves: list[Any], length: int | None) -> int:
    if length is not None and (not isinstance(length, int) or isinstance(length, bool)):
        raise InvalidArgumentError(
            f"scan: length={describe(length)} is not accepted; length must be an int (the "
            "number of steps, needed where xs is None)"
        )
    for t in leaves:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise InvalidArgumentError(
                f"scan: xs holds {describe(t)}; every leaf of xs must be a tensor with a "
                "leading axis to scan over"
            )
    sizes = {t.shape[0] for t in leaves}
    if len(sizes) > 1:
        raise InvalidArgumentError(
            f"scan: the leaves of xs have leading sizes {sorted(sizes)}; they must share one "
            "(the number of steps)"
        )
    if not sizes:
        if length is None:
            raise InvalidArgumentError(
                "scan: xs holds no tensor and length=None; pass length= (the number of steps)"
            )
        return length
    (size,) = sizes
    if length is not None and length != size:
        raise InvalidArgumentError(
            f"scan: length={length} but xs's leading size is {size}; they must agree"
        )
    return int(size)


def _pair(result: Any, i: int) -> tuple[Any, Any]:
    if not isinstance(result, tuple) or len(result) != 2:
        raise InvalidArgumentError(
            f"scan: f returned {describe(result)} at step {i}; f must return a pair (carry, y) "
            "(y may be None)"
        )
    return result[0], result[1]


def _stacked(ys: list[Any]) -> Any:
    """The steps' ``y`` stacked leaf by leaf along a new first axis (None stays None)."""
    if not ys:
        return None
    flat = [pytree.tree_flatten(y) for y in ys]
    spec = flat[0][1]
    columns = zip(*(leaves for leaves, _ in flat), strict=True)
    stacked = [
        None
        if col[0] is None
        else torch.stack(list(col))
        if isinstance(col[0], torch.Tensor)
        else list(col)
        for col in columns
    ]
    return pytree.tree_unflatten(stacked, spec)
