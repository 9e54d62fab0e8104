"""The transform stack: which functrans transforms are running, outermost first, so an error
raised inside nested transforms says where it happened ("inside jit(vmap(grad(loss)))").

Each transform runs the user's function inside :func:`transform_frame`. When an exception
leaves the innermost of two or more frames, it is named once with the whole stack and the
user's line:

- a :class:`FunctransError` keeps its type; its message gets the stack in front;
- any other exception becomes also a :class:`TransformError`, still of its own type (a
  ``RuntimeError`` from a shape mismatch is caught by ``except RuntimeError``). A user's own
  exception class is renamed in place (same object, arguments and attributes) and gets the
  stack, op and line as a note; a built-in one (which Python cannot rename) is re-raised as a
  copy with the same arguments, from the original, with the stack in front of its message
  (a ``KeyError`` keeps its key and gets a note). ``StopIteration`` passes through untouched.

A single transform leaves errors as they are: its own messages already name the function.

>>> import torch, functrans as ft
>>> def loss(x):
...     return (x @ torch.ones(5)).sum()  # x has 3 columns: a shape error
>>> try:
...     ft.jit(ft.vmap(ft.grad(loss)))(torch.ones(4, 3))
... except ft.FunctransError as e:
...     print(str(e).splitlines()[0])
inside jit(vmap(grad(loss))): RuntimeError (`aten.mv.default`...) at <doctest ...>:2: ...
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .context import culprit, user_line
from .errors import FunctransError
from .marks import leave, marked

__all__ = ["TransformError", "describe_stack", "transform_frame"]


@dataclass(frozen=True)
class Frame:
    """One running transform: its name (``grad``) and the function it transforms; ``shown``:
    named in messages (a ``jit`` that ``grad`` runs under to reuse its trace is not: it is the
    user's ``grad`` that runs, though it traces once, as a jit)."""

    transform: str
    fn: Callable[..., Any]
    shown: bool = True


_STACK: contextvars.ContextVar[tuple[Frame, ...]] = contextvars.ContextVar(
    "functrans_transform_stack", default=()
)


@dataclass(frozen=True)
class Named:
    """The record left on an exception once it is named with the transform stack: the frames
    further out leave it as it is."""


class ControlFlow(Exception):
    """Base of functrans' internal control-flow exceptions (a trace stopped on purpose, caught
    by functrans itself): passed through nested transforms as themselves, never renamed."""


class TransformError(FunctransError):
    """A failure inside nested transforms; the message names the transform stack and the
    user's line, ``__cause__`` is the original exception. Instances are also of the original
    exception's type where Python allows it (``except RuntimeError`` still catches them)."""


def fn_name(fn: Callable[..., Any]) -> str:
    """The user-facing name of ``fn`` (functools.wraps layers and partials see through)."""
    inner = getattr(fn, "func", fn)  # functools.partial
    return str(getattr(inner, "__qualname__", None) or type(inner).__name__).split(".")[-1]


def describe_stack(frames: tuple[Frame, ...]) -> str:
    """``jit(vmap(grad(loss)))`` for frames jit, vmap, grad with ``loss`` innermost.

    >>> describe_stack((Frame("jit", print), Frame("grad", len)))
    'jit(grad(len))'
    """
    frames = tuple(f for f in frames if f.shown)
    text = fn_name(frames[-1].fn) if frames else "?"
    for frame in reversed(frames):
        text = f"{frame.transform}({text})"
    return text


def current_stack() -> tuple[Frame, ...]:
    """The transforms running now, outermost first."""
    return _STACK.get()


class transform_frame:  # used as a function: with transform_frame(...)
    """Run the body as transform ``transform`` of ``fn``; name errors raised inside nested
    transforms (see the module docstring). A class, not a generator: a ``StopIteration`` raised
    inside passes through as itself."""

    def __init__(self, transform: str, fn: Callable[..., Any], shown: bool = True) -> None:
        stack = _STACK.get()
        inner = next((f for f in reversed(stack) if f.shown), None)
        if inner is not None and inner.transform == transform and inner.fn is fn:
            shown = False  # re-entered for the same function (grad through its own jit)
        self.frames = (*stack, Frame(transform, fn, shown))

    def __enter__(self) -> None:
        self.token = _STACK.set(self.frames)

    def __exit__(self, kind: Any, e: BaseException | None, tb: Any) -> Literal[False]:
        _STACK.reset(self.token)
        named = (
            isinstance(e, Exception)
            and sum(f.shown for f in self.frames) >= 2
            and not marked(e, Named)
            and not isinstance(e, ControlFlow)
            and not isinstance(e, StopIteration | StopAsyncIteration)
        )
        if named:
            renamed = _name(e, self.frames)  # type: ignore[arg-type]  # an Exception
            if renamed is not e:
                raise renamed from e
        return False  # the exception goes on, as itself


_CLASSES: dict[type[Exception], type[Exception]] = {}


def _error_class(kind: type[Exception]) -> type[Exception]:
    """``TransformError`` that is also a ``kind`` (one class per kind)."""
    if kind not in _CLASSES:
        _CLASSES[kind] = type(f"TransformError[{kind.__name__}]", (TransformError, kind), {})
    return _CLASSES[kind]


def _name(e: Exception, frames: tuple[Frame, ...]) -> Exception:
    """``e`` named: the same object where Python allows (its type, arguments and attributes
    stay what ``except`` clauses and handlers expect), else a copy with the same arguments.
    The caller raises what this returns."""
    stack = f"inside {describe_stack(frames)}"
    if isinstance(e, FunctransError):
        if e.args and isinstance(e.args[0], str):
            e.args = (f"{stack}: {e.args[0]}", *e.args[1:])
        else:
            e.add_note(stack)
        leave(e, Named())
        return e
    head = f"{stack}: {type(e).__name__}{culprit(e)}{user_line(e, cells=True)}"
    named = e
    try:
        e.__class__ = _error_class(type(e))  # a user's exception class: renamed in place
    except TypeError:  # a built-in type's instance: a copy of the same class and arguments
        try:
            named = _error_class(type(e))(*e.args)
        except TypeError:
            return e  # cannot be mixed with TransformError (OSError...): left as it is
        named.__notes__ = list(getattr(e, "__notes__", []))
    if type(e).__module__ == "builtins" and not isinstance(e, KeyError) and _one_message(e):
        named.args = (f"{head}\n{e.args[0]}",)  # torch's and Python's own errors
    else:
        named.add_note(head)  # a user's exception or a KeyError: its arguments are data
    leave(named, Named())
    return named


def _one_message(e: Exception) -> bool:
    return len(e.args) == 1 and isinstance(e.args[0], str)
