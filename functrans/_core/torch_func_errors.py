"""torch.func's own argument errors, named: what the wrapped transforms raise, translated.

``ft.vmap``, ``jvp``, ``jacrev``... call torch.func, whose complaints about their arguments
(``in_dims`` that do not fit, a non-tensor primal, an integer input to ``jacrev``) are plain
``ValueError`` s and ``RuntimeError`` s. :func:`torch_func_arguments` re-raises them as
:class:`~functrans.InvalidArgumentError` naming the transform (still an instance of what torch
raised), while an error of the user's function, marked by :func:`user_calls`, passes through as
it is.

>>> def boom():
...     raise ValueError("the user's own")
>>> try:
...     with torch_func_arguments("vmap"):
...         user_calls(boom)()
... except ValueError as e:
...     print(type(e).__name__, marked(e, UserError))
ValueError True
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from .errors import InvalidArgumentError
from .marks import leave, marked

__all__ = ["UserError", "torch_func_arguments", "user_calls"]


@dataclasses.dataclass(frozen=True)
class UserError:
    """The record :func:`user_calls` leaves on an exception the user's function raised."""


def user_calls(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func``, marking any exception it raises as the user's own, so that
    :func:`torch_func_arguments` lets it through unchanged."""
    import functools

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except BaseException as e:
            leave(e, UserError())
            raise

    return run


def _raised_in_user_code(exc: BaseException) -> bool:
    from .context import LIBRARY_DIRS

    frames = traceback.extract_tb(exc.__traceback__)
    return any(not f.filename.startswith(LIBRARY_DIRS) for f in frames)


@contextlib.contextmanager
def torch_func_arguments(where: str, hint: Callable[[], str] = lambda: "") -> Iterator[None]:
    """Re-raise what torch.func raises about the transform's arguments (``in_dims`` that do
    not fit, a non-tensor primal, an integer input to ``jacrev``...) as
    :class:`InvalidArgumentError` naming the transform; errors from the user's function (see
    :func:`user_calls`) and functrans' own errors pass through as they are."""
    from .errors import FunctransError

    try:
        yield
    except FunctransError:
        raise
    except (ValueError, RuntimeError, TypeError, IndexError, AttributeError) as e:
        if marked(e, UserError) or _raised_in_user_code(e):
            raise
        message = f"{where}: {e}{hint()}"
        try:
            named = _argument_error(type(e))(message)
        except TypeError:  # a class with its own constructor or layout
            named = InvalidArgumentError(message)
        raise named from e


_ARGUMENT_ERRORS: dict[type[Exception], type[InvalidArgumentError]] = {}


def _argument_error(kind: type[Exception]) -> type[InvalidArgumentError]:
    """:class:`InvalidArgumentError` that is also a ``kind`` (``except RuntimeError`` around a
    torch.func call still catches what torch raised)."""
    if issubclass(InvalidArgumentError, kind):
        return InvalidArgumentError
    if kind not in _ARGUMENT_ERRORS:
        name = f"InvalidArgumentError[{kind.__name__}]"
        _ARGUMENT_ERRORS[kind] = type(name, (InvalidArgumentError, kind), {})  # may raise TypeError
    return _ARGUMENT_ERRORS[kind]
