"""One exception hierarchy for the whole library.

Every message names the user's op or argument, says what was expected and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "FunctransError",
    "InvalidArgumentError",
    "InvalidPartitionError",
    "NonScalarOutputError",
    "TraceError",
    "UnknownNameError",
    "UnsupportedOpError",
]


class FunctransError(Exception):
    """Base class of every error functrans raises on purpose.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: x.sin().sum())(torch.ones(3))
    >>> try:
    ...     ft.partition(jg, "no_such_strategy")
    ... except ft.FunctransError as e:
    ...     print(type(e).__name__, "-", e)
    UnknownNameError - unknown partition strategy 'no_such_strategy'; registered: ...
    """


class TraceError(FunctransError):
    """The function could not be traced to a pure ATen graph (mutation, data-dependent flow...)."""


class UnsupportedOpError(FunctransError):
    """An op the requested transform or backend cannot handle.

    >>> import torch, functrans as ft
    >>> try:
    ...     ft.trace(lambda a: a * 2)(torch.eye(2).to_sparse())
    ... except ft.UnsupportedOpError as e:
    ...     print(e)
    <lambda>: input a is a torch.sparse_coo tensor; functrans traces dense (strided) tensors ...
    """


class InvalidArgumentError(FunctransError, TypeError, ValueError):
    """An argument or option with a wrong name, type or value (a strategy option, a strategy
    that is neither a name nor a callable, ``grad`` of an integer tensor...); the message names
    it, shows the value and says what is accepted.

    It is also a ``TypeError`` and a ``ValueError`` (what Python raises for a wrong type or
    value), so callers that caught those before keep working.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: x.sin().sum())(torch.ones(3))
    >>> try:
    ...     ft.partition(jg, "min_cut", budget=0.5)
    ... except TypeError as e:
    ...     print(type(e).__name__, "-", e)
    InvalidArgumentError - min_cut: unknown option budget=0.5; accepted options: ...
    """


class InvalidPartitionError(FunctransError):
    """A saved set or strategy result that cannot produce correct forward/backward graphs.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: x.sin().sum())(torch.ones(3))
    >>> try:
    ...     ft.partition(jg, lambda joint: 42)
    ... except ft.InvalidPartitionError as e:
    ...     print(e)
    partition strategy '<lambda>' returned 42 (int), which is not iterable; a strategy must ...
    """


class UnknownNameError(FunctransError, KeyError):
    """A registry lookup with a name nobody registered; the message lists the known names."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class NonScalarOutputError(FunctransError, ValueError):
    """grad/value_and_grad on a function whose output is not a scalar float tensor."""
