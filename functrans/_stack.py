"""The transform stack: which functrans transforms are running, outermost first, so an error
raised inside nested transforms says where it happened ("inside jit(vmap(grad(loss)))").

Each transform runs the user's function inside :func:`transform_frame`. When an exception
leaves the innermost of two or more frames, it is named once with the whole stack and the
user's line:

- a :class:`FunctransError` keeps its type; its message gets the stack in front;
- any other exception becomes a :class:`TransformError` that is *also* an instance of the
  original type (a ``RuntimeError`` from a shape mismatch stays catchable as one), with the
  original as its ``__cause__``.

A single transform leaves errors as they are: its own messages already name the function.

>>> import torch, functrans as ft
>>> def loss(x):
...     return (x @ torch.ones(5)).sum()  # x has 3 columns: a shape error
>>> try:
...     ft.jit(ft.vmap(ft.grad(loss)))(torch.ones(4, 3))
... except ft.FunctransError as e:
...     print(str(e).splitlines()[0])
inside jit(vmap(grad(loss))): RuntimeError (`aten.mv.default`, ...) at <doctest ...>:2: ...
"""

from __future__ import annotations

import contextlib
import contextvars
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ._errors import FunctransError

__all__ = ["TransformError", "describe_stack", "transform_frame"]


@dataclass(frozen=True)
class Frame:
    """One running transform: its name (``grad``) and the function it transforms."""

    transform: str
    fn: Callable[..., Any]


_STACK: contextvars.ContextVar[tuple[Frame, ...]] = contextvars.ContextVar(
    "functrans_transform_stack", default=()
)
_NAMED = "__functrans_stack_named__"
#: Class attribute of functrans' internal control-flow exceptions (a retry): never renamed.
CONTROL_FLOW = "__functrans_control_flow__"


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
    text = fn_name(frames[-1].fn) if frames else "?"
    for frame in reversed(frames):
        text = f"{frame.transform}({text})"
    return text


def current_stack() -> tuple[Frame, ...]:
    """The transforms running now, outermost first."""
    return _STACK.get()


@contextlib.contextmanager
def transform_frame(transform: str, fn: Callable[..., Any]) -> Iterator[None]:
    """Run the body as transform ``transform`` of ``fn``; name errors raised inside nested
    transforms (see the module docstring)."""
    frames = (*_STACK.get(), Frame(transform, fn))
    token = _STACK.set(frames)
    try:
        yield
    except Exception as e:
        if len(frames) < 2 or getattr(e, _NAMED, False) or getattr(e, CONTROL_FLOW, False):
            raise
        named = _name(e, frames)
        if named is e:
            raise
        raise named from e
    finally:
        _STACK.reset(token)


def _user_line(e: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of user code (notebook cells and doctests included)."""
    from ._trace import LIBRARY_DIRS

    frames = [
        fr
        for fr in traceback.extract_tb(e.__traceback__)
        if not fr.filename.startswith((*LIBRARY_DIRS, "<frozen"))
    ]
    return frames[-1] if frames else None


_CLASSES: dict[type[Exception], type[Exception]] = {}


def _error_class(kind: type[Exception]) -> type[Exception]:
    """``TransformError`` that is also a ``kind`` (one class per kind)."""
    if kind not in _CLASSES:
        _CLASSES[kind] = type(f"TransformError[{kind.__name__}]", (TransformError, kind), {})
    return _CLASSES[kind]


def _name(e: Exception, frames: tuple[Frame, ...]) -> Exception:
    stack = f"inside {describe_stack(frames)}"
    if isinstance(e, FunctransError):
        if e.args and isinstance(e.args[0], str):
            e.args = (f"{stack}: {e.args[0]}", *e.args[1:])
        else:
            e.add_note(stack)
        setattr(e, _NAMED, True)
        return e
    from ._trace import culprit

    fr = _user_line(e)
    where = f" at {fr.filename}:{fr.lineno}: `{(fr.line or '').strip()}`" if fr else ""
    message = f"{stack}: {type(e).__name__}{culprit(e)}{where}\n{e}"
    named: Exception
    try:
        named = _error_class(type(e))(message)
    except TypeError:  # a layout Python cannot mix (OSError...): a plain TransformError
        named = TransformError(message)
    setattr(named, _NAMED, True)
    return named
