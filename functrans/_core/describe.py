"""Short descriptions of user values for error messages, and the first check every entry makes."""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Iterable

from .errors import InvalidArgumentError

__all__ = ["check_numpy_leaves", "describe"]

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


def describe(value: object) -> str:
    """A short repr of ``value`` and its type, for messages.

    >>> describe("x"), describe(float("nan")), describe(None)
    ("'x' (str)", 'nan (float)', 'None')
    """
    return "None" if value is None else f"{_REPR.repr(value)} ({type(value).__name__})"


def check_numpy_leaves(
    where: str, leaves: Iterable[object], names: Callable[[int], str] | str
) -> None:
    """Raise :class:`InvalidArgumentError` at the first numpy array among ``leaves`` (a static
    value that a trace would bake in and compare by ``==``): convert it to a tensor.

    >>> import numpy as np
    >>> check_numpy_leaves("jit(f)", [np.ones(2)], lambda i: f"argument {i}")
    Traceback (most recent call last):
    ...
    functrans._core.errors.InvalidArgumentError: jit(f): argument 0 is a numpy.ndarray ...
    """
    import numpy as np

    for i, leaf in enumerate(leaves):
        if isinstance(leaf, np.ndarray):
            what = names if isinstance(names, str) else names(i)
            raise InvalidArgumentError(
                f"{where}: {what} is a numpy.ndarray (shape {list(leaf.shape)}, dtype "
                f"{leaf.dtype}); functrans transforms take torch tensors: pass "
                "torch.from_numpy(array) (or torch.as_tensor) instead"
            )
