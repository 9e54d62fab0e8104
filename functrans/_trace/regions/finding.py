"""Finding blocks while a trace runs: members of ``nn.ModuleList``, ``nn.Sequential`` and
``nn.ModuleDict`` with a sibling of their class, and modules and functions :func:`region`
marks (see :mod:`functrans._trace.regions`, which traces and reuses them).

For the length of a trace (:func:`finding_blocks`, one of the trace contexts)
``Module.__call__``, ``ModuleList``'s iteration and indexing and ``ModuleDict``'s ``values``,
``items`` and indexing are patched: reaching into a container marks its members that have a
sibling of the same class, and a marked module's call goes through
:func:`module_region`. Plain functions called as blocks are found
by :mod:`functrans._trace.regions.functions`.

>>> import torch, functrans as ft
>>> @ft.region
... def layer(w, x):
...     return torch.tanh(x @ w)
>>> layer(torch.eye(2), torch.ones(1, 2))  # outside a trace: the function itself
tensor([[0.7616, 0.7616]])
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from functrans._core.errors import InvalidArgumentError
from functrans._core.marks import leave, marked
from functrans._trace import regions as _regions

from .. import reads
from ..session import Slot
from .keys import (
    SideEffect,
    attrs_snapshot,
    block_state,
    code_key,
    global_hooks,
    has_hooks,
    not_reading,
    restore_changed,
)
from .state import StateCall

__all__ = ["Marked", "finding_blocks", "module_region", "region"]

_F = TypeVar("_F", bound=Callable[..., Any])


#: the blocks found so far in the running trace (None: not looking)
_CANDIDATES: Slot[dict[int, torch.nn.Module] | None] = Slot("block candidates", None)


@dataclass(frozen=True)
class Marked:
    """The record :func:`region` leaves on a module it marks as a block."""


def _mark_siblings(mods: Any) -> None:
    found = _CANDIDATES.get()
    if found is None:
        return
    members = [m for m in mods if isinstance(m, torch.nn.Module)]
    by_type: dict[type, int] = {}
    for m in members:
        by_type[type(m)] = by_type.get(type(m), 0) + 1
    for m in members:
        if by_type[type(m)] > 1:
            found[id(m)] = m


_ORIGINAL_CALL = torch.nn.Module.__call__


def _patched_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    found = _CANDIDATES.get()
    if found is None or _regions._SESSION.get() is None or _regions._INSIDE.get():
        return _ORIGINAL_CALL(self, *args, **kwargs)
    if isinstance(self, torch.nn.Sequential):
        _mark_siblings(self._modules.values())
    if id(self) in found or marked(self, Marked):
        return module_region(self, _ORIGINAL_CALL, args, kwargs)
    return _ORIGINAL_CALL(self, *args, **kwargs)


def module_region(m: torch.nn.Module, original: Callable[..., Any], args: Any, kw: Any) -> Any:
    """A marked block's call: a region (see :mod:`functrans._trace.regions`), or ``original``
    where it cannot be one (hooks, arguments that are neither tensors, plain values nor a
    state a stand-in answers for, nothing to differentiate)."""

    def eager() -> Any:
        return original(m, *args, **kw)

    with not_reading():  # the block's key is functrans' reading, not the step's
        hooked = has_hooks(m) or global_hooks()
        state = None if hooked else block_state(m)
    if state is None:
        return eager()
    states: list[StateCall] = []
    split = _regions._split_args(args, kw, states)
    if split is None:
        return eager()
    inputs, statics, leaves = split
    slots = state.slots
    params = [table[k] for table, k in slots]
    tensors = [*inputs, *params]
    if not _regions._usable(tensors):
        return eager()
    n_in = len(inputs)
    updated = states[0] if states else None

    def call(flat: list[torch.Tensor]) -> Any:
        given = list(leaves)
        if updated is not None:  # the block updates a stand-in; what it was given, output
            stand_in = updated.stand_in(flat)
            given[updated.position] = stand_in
        a, k = _regions._rebuild(given, statics, flat[:n_in])
        with not_reading():  # our bookkeeping is no read of the block's
            swapped = [(table, name, table[name]) for table, name in slots]
            snap = attrs_snapshot(m)
            for (table, name), t in zip(slots, flat[n_in:], strict=False):
                table[name] = t
        try:
            out = original(m, *a, **k)
        finally:
            with not_reading():
                for table, name, t in swapped:
                    table[name] = t
                changed = restore_changed(snap)
            if changed:
                raise SideEffect
        return out if updated is None else (out, stand_in.outputs)

    ran = _Eager()
    result = _regions.call_region(
        (type(m), state.structure, statics),
        tensors,
        call,
        lambda: ran.run(eager),
        type(m).__qualname__,
        (m, state.attrs),
        state=updated,
    )
    if result is ran:
        return ran.value
    if updated is None:
        return result
    out, outputs = cast(tuple[Any, list[torch.Tensor]], result)
    updated.replay(outputs, tensors, m)
    return out


class _Eager:
    """A block call that ran as written (not a region): its value."""

    value: Any = None

    def run(self, eager: Callable[[], Any]) -> _Eager:
        self.value = eager()
        return self


def _marking(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (a container's iteration, indexing, ``values`` or ``items``) marking the
    container's members with a sibling of their class first. A read of the patched method
    during a trace (``layers.values``) records ``original``, the method a guard finds after
    it."""

    def patched(self: Any, *args: Any) -> Any:
        _mark_siblings(self._modules.values())
        return original(self, *args)

    leave(patched, reads.StandsFor(original))
    return patched


#: (class, method name, patched) while a trace runs: the containers whose members with a
#: sibling of their class are blocks (a ``ModuleDict`` of layers is torchtitan's stack)
_PATCHES: tuple[tuple[type, str, Callable[..., Any]], ...] = (
    (torch.nn.Module, "__call__", _patched_call),
    *(
        (cls, name, _marking(getattr(cls, name)))
        for cls, names in (
            (torch.nn.ModuleList, ("__iter__", "__getitem__")),
            (torch.nn.ModuleDict, ("__getitem__", "values", "items")),
        )
        for name in names
    ),
)


@contextlib.contextmanager
def finding_blocks(_traced: Any = None) -> Iterator[None]:
    """While a trace runs (a trace extension): module calls of blocks go through
    :func:`module_region`."""
    if _regions._SESSION.get() is None or _CANDIDATES.get() is not None:
        yield
        return
    token = _CANDIDATES.set({})
    before = [(cls, name, cls.__dict__[name]) for cls, name, _ in _PATCHES]
    # make_fx's tracer calls modules through the module global it saved at import
    symbolic = torch.fx._symbolic_trace
    saved = symbolic._orig_module_call
    symbolic._orig_module_call = _patched_call
    for cls, name, patched in _PATCHES:  # patched while tracing, restored after
        setattr(cls, name, patched)
    try:
        yield
    finally:
        for cls, name, original in before:
            setattr(cls, name, original)
        symbolic._orig_module_call = saved
        _CANDIDATES.reset(token)


def region(fn: _F) -> _F:
    """Mark a function (or a module) as a repeated region: inside ``ft.jit`` (and
    ``ft.joint``), its calls with the same structure are traced once and the graph is
    copied for each call, with that call's tensors; the compiled step is the one unrolled
    tracing gives. A function's non-tensor arguments are part of the structure; tensors it
    reads from closures or globals are not allowed to differ between calls (pass them as
    arguments). Members of ``nn.ModuleList`` and ``nn.Sequential`` are regions without it.

    >>> import torch, functrans as ft
    >>> @ft.region
    ... def block(w, x):
    ...     return torch.tanh(x @ w)
    >>> def f(ws, x):
    ...     for w in ws:
    ...         x = block(w, x)
    ...     return x.sum()
    >>> ws = [torch.randn(4, 4, requires_grad=True) for _ in range(3)]
    >>> loss = ft.jit(f)(ws, torch.randn(2, 4))
    >>> loss.backward()
    >>> [w.grad.shape for w in ws]
    [torch.Size([4, 4]), torch.Size([4, 4]), torch.Size([4, 4])]
    """
    if isinstance(fn, torch.nn.Module):
        leave(fn, Marked())
        return cast(_F, fn)
    if not callable(fn):
        raise InvalidArgumentError(
            f"region: fn={fn!r} is not accepted; pass a function or an nn.Module"
        )

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        found = _regions.function_call(args, kwargs)
        if found is None:
            return fn(*args, **kwargs)

        def call(flat: list[torch.Tensor]) -> Any:
            a, k = found.rebuild(flat)
            return fn(*a, **k)

        what = getattr(fn, "__qualname__", repr(fn))
        parts = ("fn", code_key(fn), found.statics)
        return _regions.call_region(parts, found.tensors, call, lambda: fn(*args, **kwargs), what)

    return cast(_F, wrapper)
