"""Plain functions called as blocks: the JAX-style loop ``for p in params: x = block(p, x)``.

Research code written functionally has no ``nn.ModuleList`` to say where its blocks are: a
block is a function, called in a loop over a list of parameter pytrees. While a joint trace
runs, the user functions the traced code names (module globals and closure cells, followed
from the traced function through the user functions they name) are called through a
wrapper, put where the name is held for the length of the trace and taken away after. A call
of a wrapped function is traced inline the first time it is called with its arguments'
structure (their pytree and plain values; the function's code and closure); a later call with
that structure is a region (:mod:`functrans._trace.regions`: traced once per key, the key
:func:`functrans.region` uses, which adds the tensors' metadata, and reused for every further
call with that key) where the first call made at least :data:`MIN_OPS` ATen ops, so a small
helper called twice stays inline.

Soundness is the region's: a call reuses a region only under the same key, and a block that
cannot be one (it returns something other than tensors, changes the containers it was passed,
fails to trace on its own) is traced inline. What the trace reads is recorded as before (the
reads recorder learns the functions before they are wrapped, so a guard compares the user's
function, not the wrapper). Python side effects of a repeated function on anything but its
arguments happen when it is traced, once per structure rather than once per call: as for any
code under ``ft.jit``, whose Python runs only when it traces.

>>> import torch, functrans as ft
>>> from functrans._trace import regions
>>> def layer(p, x):
...     h = torch.tanh(x @ p["w1"] + p["b1"])
...     a = torch.softmax(h @ h.T, dim=-1) @ h
...     h = torch.tanh(a @ p["w2"] + p["b2"]) * torch.sigmoid(h) + torch.cos(x)
...     h = torch.nn.functional.gelu(h @ p["w1"].T) * torch.rsqrt(1 + h * h)
...     return torch.nn.functional.layer_norm(h + x, (4,))
>>> def loss(params, x):
...     for p in params:
...         x = layer(p, x)
...     return x.sum()
>>> shapes = {"w1": (4, 4), "b1": (4,), "w2": (4, 4), "b2": (4,)}
>>> ps = [{k: torch.randn(s, requires_grad=True) for k, s in shapes.items()} for _ in range(4)]
>>> before = regions.stats.reused
>>> ft.jit(loss)(ps, torch.randn(3, 4)).backward()
>>> regions.stats.reused - before  # calls 3 and 4 reuse the region traced for call 2
2
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from functrans._trace import regions as _regions

from ..reads import _role, code_reads
from .keys import code_key

__all__ = ["MIN_OPS", "repeated_functions"]

#: the fewest ATen ops a function's first call makes for its later calls to become a region:
#: a region call costs its own bookkeeping (a cut, a compiled call), worth it for a block of a
#: model (a pre-norm transformer block makes about 40), not for a helper (an einsum makes 12)
MIN_OPS = 24

#: how deep user code is followed from the traced function, and how many functions at most
_DEPTH, _MOST = 4, 256


def _user_function(value: Any) -> TypeGuard[types.FunctionType]:
    return (
        type(value) is types.FunctionType
        and _role(value.__code__.co_filename) == "user"
        and not value.__code__.co_flags & (0x20 | 0x80 | 0x200)  # generators, coroutines
        and _CALL not in (value.__code__.co_varnames)
    )


def _roots(fn: Any) -> list[types.FunctionType]:
    """The user functions whose code the traced ``fn`` runs first: through
    ``functools.wraps`` layers, a module's ``forward`` (its submodules' too)."""
    out: list[types.FunctionType] = []
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if isinstance(fn, torch.nn.Module):
            for m in fn.modules():
                forward = m.__dict__.get("forward", type(m).forward)
                out.append(getattr(forward, "__func__", forward))
        else:
            out.append(getattr(fn, "__func__", fn))  # a bound method's function
        fn = getattr(fn, "__wrapped__", None)
    return [
        f for f in out if type(f) is types.FunctionType and _role(f.__code__.co_filename) == "user"
    ]


def _named(roots: list[types.FunctionType]) -> list[types.FunctionType]:
    """The user functions ``roots`` name (globals their code loads, cells they close over),
    followed through what those functions name (breadth first, :data:`_DEPTH` levels, at most
    :data:`_MOST` functions)."""
    found: list[types.FunctionType] = []
    visited = {id(f) for f in roots}
    level = list(roots)
    for _ in range(_DEPTH):
        below: list[types.FunctionType] = []
        for fn in level:
            held = [fn.__globals__.get(name) for name in code_reads(fn.__code__)[0]]
            for cell in fn.__closure__ or ():
                try:
                    held.append(cell.cell_contents)
                except ValueError:  # not bound yet
                    continue
            for value in held:
                if id(value) in visited or not _user_function(value) or len(found) >= _MOST:
                    continue
                visited.add(id(value))
                found.append(value)
                below.append(value)
        level = below
    return found


#: the keyword-only argument through which a diverted function finds its call (an unlikely name)
_CALL = "__functrans_block_call__"


@functools.lru_cache(maxsize=256)
def _diversion(freevars: tuple[str, ...], name: str, qualname: str) -> types.CodeType:
    """Code that calls its keyword default :data:`_CALL` with its arguments, closing over
    ``freevars`` (which it never reads) so that it can stand in a function closing over them."""
    bind = "".join(f"    {v} = None\n" for v in freevars)
    read = f"        if False:\n            {', '.join(freevars)}\n" if freevars else ""
    source = (
        f"def _outer():\n{bind}"
        f"    def diverted(*args, {_CALL}, **kwargs):\n{read}"
        f"        return {_CALL}(args, kwargs)\n"
        "    return diverted\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, __file__, "exec"), namespace)  # our own fixed source
    code: types.CodeType = namespace["_outer"]().__code__
    return code.replace(co_name=name, co_qualname=qualname)


class _Diverted:
    """A user function whose calls go through :func:`_called` while a trace runs: its code is
    swapped for a diversion (so every holder of the function, a global, a cell, a list, sees
    it, and what the function closes over and reads stays where it was), and a copy of the
    function keeps the original code."""

    def __init__(self, fn: types.FunctionType) -> None:
        self.fn, self.code, self.kwdefaults = fn, fn.__code__, fn.__kwdefaults__
        self.original = types.FunctionType(
            fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
        )
        self.original.__kwdefaults__ = (
            None if fn.__kwdefaults__ is None else dict(fn.__kwdefaults__)
        )
        self.original.__qualname__ = fn.__qualname__
        self.diversion = _diversion(self.code.co_freevars, self.code.co_name, fn.__qualname__)
        self.call = functools.partial(_called, self.original)

    def __enter__(self) -> None:
        if self.diversion.co_freevars != self.code.co_freevars:
            return  # not expected: the diversion could not close over the same names
        # code that inspects the function meanwhile (a decorator binding its arguments by
        # signature) sees the user's parameters, not the diversion's
        self.signed = "__signature__" not in vars(self.fn)
        if self.signed:
            self.fn.__signature__ = inspect.signature(self.original)  # type: ignore[attr-defined]  # read by inspect.signature
        self.fn.__code__ = self.diversion
        self.fn.__kwdefaults__ = {_CALL: lambda args, kwargs: self.call(args, kwargs)}

    def __exit__(self, *exc: object) -> None:
        if self.fn.__code__ is self.diversion:  # unless the traced code swapped it meanwhile
            self.fn.__code__ = self.code
            self.fn.__kwdefaults__ = self.kwdefaults
        if getattr(self, "signed", False):
            vars(self.fn).pop("__signature__", None)


@contextlib.contextmanager
def repeated_functions(traced: Callable[..., Any] | None) -> Iterator[None]:
    """While a joint trace of ``traced`` runs (one of the trace contexts): the user functions
    it names are called through :func:`_called` (see the module docstring)."""
    if traced is None or _regions._SESSION.get() is None or _regions._INSIDE.get():
        yield
        return
    with contextlib.ExitStack() as stack:
        for fn in _named(_roots(traced)):
            stack.enter_context(_Diverted(fn))
        yield


def _called(fn: types.FunctionType, args: Any, kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``: inline, or as a region (see the module docstring)."""
    found = _regions.function_call(args, kwargs)
    s = _regions._SESSION.get()
    if found is None or s is None:
        return fn(*args, **kwargs)
    parts = ("fn", code_key(fn), found.statics)
    first = s.functions.get(parts)
    if first is None:
        made = _ops_made(lambda: fn(*args, **kwargs))
        s.functions[parts] = made.ops
        return made.result
    if first < MIN_OPS:
        return fn(*args, **kwargs)

    def call(flat: list[torch.Tensor]) -> Any:
        a, k = found.rebuild(flat)
        given, spec = pytree.tree_flatten((a, k))
        out = fn(*a, **k)
        now, spec_now = pytree.tree_flatten((a, k))
        if spec_now != spec or any(x is not y for x, y in zip(now, given, strict=True)):
            raise _regions.SideEffect  # it wrote into a list or dict it was passed
        return out

    what = f"{fn.__qualname__} (called as a block)"
    return _regions.call_region(
        parts, found.tensors, call, lambda: fn(*args, **kwargs), what, tolerant=True
    )


@dataclass(frozen=True)
class _Made:
    result: Any
    ops: int


def _ops_made(run: Callable[[], Any]) -> _Made:
    """``run()`` and how many nodes it added to the enclosing trace's graph."""
    mode = get_proxy_mode()
    graph = None if mode is None else mode.tracer.graph
    before = 0 if graph is None else len(graph.nodes)
    result = run()
    return _Made(result, 0 if graph is None else len(graph.nodes) - before)
