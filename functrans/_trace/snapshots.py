"""Snapshots of contents: copies a guard compares a container or an object's attributes with.

A read of a whole content (a list, a dict read whole, a user class's attributes) keeps a
:func:`snapshot`, which compares equal to a value with the same content: plain data by value,
containers item by item, small numpy arrays by value (:class:`ArrayValue`), tensors as any
tensor (:data:`ANY_TENSOR`: tensors are graph inputs) and other objects by identity
(:class:`Same`).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from .dict_views import DictView
from .read_records import Source, is_atom

__all__ = ["ANY_TENSOR", "AnyTensor", "ArrayValue", "Learner", "Same", "snapshot"]


class Learner(Protocol):
    """Who learns the objects a snapshot meets: the recorder of the trace, which records their
    own reads from then on."""

    def learn(self, obj: Any, source: Source) -> Any:
        """Record what reads of ``obj`` (reached at ``source``) see from now on."""
        ...


class Same:
    """Stands for an object in a snapshot: equal to that very object only."""

    __slots__ = ("obj",)
    __array_ufunc__ = None  # numpy arrays defer to this __eq__
    __hash__ = None  # type: ignore[assignment]  # compared, never hashed

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return other is self.obj

    def __ne__(self, other: object) -> bool:
        return other is not self.obj

    def __repr__(self) -> str:
        return f"<the same {type(self.obj).__qualname__}>"


class AnyTensor:
    """Stands for a tensor in a snapshot: equal to any tensor (tensors are graph inputs)."""

    __slots__ = ()
    __hash__ = None  # type: ignore[assignment]  # compared, never hashed

    def __eq__(self, other: object) -> bool:
        return issubclass(type(other), torch.Tensor)

    def __ne__(self, other: object) -> bool:
        return not issubclass(type(other), torch.Tensor)

    def __repr__(self) -> str:
        return "<a tensor>"


ANY_TENSOR = AnyTensor()


class ArrayValue:
    """Stands for a numpy array in a snapshot: equal to an array of the same dtype, shape and
    values (a copy: the original may be changed in place)."""

    __slots__ = ("array",)
    __array_ufunc__ = None  # numpy defers to this __eq__
    __hash__ = None  # type: ignore[assignment]  # compared, never hashed

    def __init__(self, array: Any) -> None:
        self.array = np.array(array, copy=True)

    def __eq__(self, other: object) -> bool:
        a = self.array
        if not issubclass(type(other), np.ndarray):
            return False
        b: Any = other
        same_nan = a.dtype.kind in "fc"
        return bool(b.dtype == a.dtype and b.shape == a.shape and np.array_equal(b, a, same_nan))

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __repr__(self) -> str:
        return f"<an array {self.array.dtype}{list(self.array.shape)}>"


#: numpy arrays up to this size are compared by value (larger ones: by identity)
_ARRAY_BYTES = 1 << 16


def snapshot(value: Any, rec: Learner | None = None, source: Source | None = None) -> Any:
    """A copy of ``value`` that compares equal (``snapshot == value``, the snapshot on the
    left) to a value with the same content: plain data by value, containers item by item,
    tensors as any tensor and other objects by identity. With ``rec``, the objects met are
    learned (their own reads are recorded).

    >>> cfg = {"dims": [2, 3], "act": "gelu"}
    >>> s = snapshot(cfg)
    >>> s == cfg, s == {"dims": [2, 4], "act": "gelu"}
    (True, False)
    """
    if issubclass(type(value), torch.Tensor):
        return ANY_TENSOR
    if is_atom(value):
        return value
    if issubclass(type(value), np.ndarray) and value.nbytes <= _ARRAY_BYTES:
        return ArrayValue(value)
    if type(value) is dict or issubclass(type(value), DictView):
        items = dict.items(value)
        return {k: snapshot(v, rec, _at(source, "item", k)) for k, v in items}
    if type(value) in (list, tuple):
        return type(value)(snapshot(v, rec, _at(source, "item", i)) for i, v in enumerate(value))
    if rec is not None and source is not None:
        rec.learn(value, source)
    return Same(value)


def _at(source: Source | None, kind: str, key: Any) -> Source | None:
    if source is None:
        return None
    label = f"{source.name}[{key!r}]"
    return source.then((kind, key), label)
